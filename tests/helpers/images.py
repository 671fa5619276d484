"""Checks of a drawn picture's file: a whole PNG or an SVG document, and its size."""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ET
from pathlib import Path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of a complete PNG file."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND", f"{path} is truncated"
    return struct.unpack(">II", data[16:24])


def svg_size(path: Path) -> tuple[str, str]:
    """The width and height attributes (with units) of an SVG document's root."""
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root.get("width"), root.get("height")
