"""The worker's engine: checks a step's items, runs them as one batched forward, samples, and
reports per item. Synchronous and gRPC-free; the servicer wraps it.

The scheduler owns the block tables (``kvfleet_common.kv_blocks``): each item brings the blocks
added to its session's table since the last step, and for a prompt's first chunk how many of its
leading tokens those blocks already hold (a prefix-cache hit); the engine keeps each session's
table as told and writes where it says. Nothing is allocated here.

Per-item failures are results, not exceptions: the rest of the batch proceeds. CACHE_MISS (the
engine does not hold the session at the stated position) leaves the session as it was; an item
that could never run as sent (a token id outside the vocabulary, a position past
``max_position``, sampling this worker cannot serve) is REJECTED and one whose sampling faults,
or whose blocks do not cover its tokens, is FAILED, and both free the session here (it ends).
Only a malformed step (a session twice) raises ``ValueError``, before anything changes; a fault
of the batched forward itself raises after freeing the step's sessions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from kvfleet_common.records import record
from kvfleet_models.config import LlamaConfig
from kvfleet_models.gguf_blocks import BlockTensor
from worker_svc import failpoints
from worker_svc.kv_cache import KVViews, PagedKVCache, make_views
from worker_svc.kv_views_mode import KVViewsMode
from worker_svc.model.cpu_backend import QUANT_MODES, default_cpu_threads, use_cpu_threads
from worker_svc.model.llama import LlamaModel, PhaseTimes
from worker_svc.platform import DEVICE_RE, DTYPES, KV_DTYPES, kv_cache_dtype, resolve_device, synchronize
from worker_svc.runner import RunItem, run_step
from worker_svc.sampling import ConstraintFactory, ConstraintRefused, Sampled, SamplingSpec, SessionSampling
from worker_svc.sampling import sample_token as sample_token  # re-exported for existing callers

_NO_LAST = -1  # the token of a last-sampled decode whose session has none here


@record
class PrefillItem:
    session_id: str
    token_ids: tuple[int, ...]  # this chunk of the prompt
    start_position: int  # tokens of this session already in the KV (0 for the first chunk)
    last_chunk: bool  # sample the first new token after this chunk
    sampling: SamplingSpec
    generated_so_far: int = 0  # index of the token to sample (for seeded sampling)
    block_ids: tuple[int, ...] = ()  # blocks added to the session's table (the scheduler's)
    # Leading tokens of the chunk whose K/V the session's blocks already hold (shared from the
    # prefix cache): not computed, only fed to the sampling history.
    cached_tokens: int = 0
    invalid: str = ""  # why the request cannot be run as sent (its sampling broke the rules)


@record
class DecodeItem:
    session_id: str
    token_id: int  # latest token; its K/V are appended now
    position: int  # == tokens already held for this session
    sampling: SamplingSpec
    generated_so_far: int
    block_ids: tuple[int, ...] = ()  # blocks added to the session's table (the scheduler's)
    invalid: str = ""  # why the request cannot be run as sent (its sampling broke the rules)
    # token_id is not given: the token this engine sampled last for the session (the scheduler
    # planned this step before that token came back to it). CACHE_MISS if there is none.
    last_sampled: bool = False


class ItemStatus(Enum):
    OK = "ok"
    CACHE_MISS = "cache_miss"  # unknown session or position != tokens held
    REJECTED = "rejected"  # cannot run as sent (see ItemResult.error); the session was freed
    FAILED = "failed"  # its sampling faulted (see ItemResult.error); the session was freed


@record
class ItemResult:
    session_id: str
    status: ItemStatus
    token_id: int | None  # None for a non-last prefill chunk or a failed item
    kv_tokens: int  # tokens held for the session after the step
    logprob: float | None = None  # when the item's sampling asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    constraint_done: bool = False  # the constraint allows nothing more after this token
    cached_tokens: int = 0  # tokens of this prefill chunk whose KV came from the prefix cache
    error: str = ""  # why, for REJECTED and FAILED


@dataclass(frozen=True)
class StepProfile:
    """Nanoseconds per phase of the step, summed over layers, host clock.

    On cuda/xpu kernels run asynchronously, so the per-phase numbers are launch times unless
    ``EngineConfig.profile_sync`` is set (which synchronises around each phase and slows the
    step); ``post_step_sync_ns`` is then where the device work shows up.
    """

    kv_view_prepare_ns: int
    attention_ns: int
    step_ns: int
    post_step_sync_ns: int  # device synchronize + copying sampled tokens to the host
    kv_write_ns: int = 0  # writing new K/V into the paged cache (both modes pay it)


@dataclass(frozen=True)
class StepOutput:
    results: list[ItemResult]  # one per item, prefill items first then decode items, in input order
    profile: StepProfile
    # Only with step(..., return_logits=True): float32 [items, vocab], the logits each sampled
    # token was drawn from; NaN rows for items that sampled nothing. For tests and debugging.
    logits: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class EngineStats:
    steps: int
    prefill_tokens: int
    decode_tokens: int
    cache_misses: int
    active_sessions: int
    used_blocks: int  # blocks in the tables of the sessions held (the scheduler's books)
    free_blocks: int
    item_errors: int = 0  # items REJECTED or FAILED (their sessions freed)
    prefix_cache_queries: int = 0  # tokens of prompt chunks (with prefix caching on)
    prefix_cache_hits: int = 0  # of which the scheduler found cached (their KV reused, not computed)


def served_length(max_model_len: int, cfg: LlamaConfig) -> int:
    """The context an engine serves: ``max_model_len`` (0 = the model's own max_position);
    ValueError naming both when it is longer than the model's."""
    if max_model_len > cfg.max_position:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds model {cfg.name!r}'s own context of {cfg.max_position} "
            f"tokens; use at most {cfg.max_position} (0 = the model's)"
        )
    return max_model_len or cfg.max_position


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N" | "xpu" | "auto" (cuda, then xpu, then cpu)
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    block_size: int = 16
    num_blocks: int = 1024
    # REBUILD (control) | PERSISTENT (candidate); a string naming one is parsed on construction.
    kv_views: KVViewsMode = KVViewsMode.REBUILD
    profile_sync: bool = False  # synchronise around phases so StepProfile shows device time
    # CPU threads a step may use; 0 = the process's torch setting (OMP_NUM_THREADS), or one for
    # a model too small to gain from more (``default_cpu_threads``). See ``use_cpu_threads``
    # for how they are split between torch and the host BLAS.
    num_threads: int = 0
    # "none" | "int8" | "gguf": the products' weights (int8 = blocks of 32 with their own
    # scales, float32 inputs (weight-only): worker_svc/model/q8.py; gguf = a
    # GGUF's own Q8_0/Q4_0/Q4_1 blocks, inputs quantized alike: worker_svc/model/gguf_quant.py,
    # the weights from load_model_blocks; CPU and float32 only).
    # Quality: tests/unit/test_quant_quality.py.
    quant: str = "none"
    # Whether the scheduler may share this worker's full blocks between sessions of one prefix
    # (it keeps the hashes: kvfleet_common.kv_blocks); reported in GetInfo. Off = no sharing.
    prefix_caching: bool = True
    # The hand-fused C ops of worker_svc/model/fused.py on a CPU (norms, RoPE, a decode
    # group's attention); False = torch's ops only (an A/B lever; KVFLEET_FUSED_OPS=0 also
    # switches them off process-wide).
    fused_ops: bool = True
    # A step of a plain Llama stack of small layers (the tiny model) as one C call, its tokens
    # rows of their own (``LlamaModel.whole_step``); False = the per-op path (an A/B lever;
    # KVFLEET_WHOLE_STEPS=0 also switches it off process-wide).
    whole_steps: bool = True
    # The longest sequence (prompt + generated) served: 0 = the model's own max_position; at
    # most that (the rotary tables and a scaled RoPE's original context stay the model's).
    max_model_len: int = 0
    # The KV cache's element type: "auto" (float32 for float32 weights, float16 for the
    # reduced-precision CPU modes, the weights' dtype off a CPU), "float32" or "float16"
    # (worker_svc/platform.py: kv_cache_dtype).
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not DEVICE_RE.match(self.device):
            raise ValueError(f"device must be cpu, cuda, cuda:N, xpu, xpu:N or auto, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        # Frozen: the parsed mode replaces the string once, here.
        object.__setattr__(self, "kv_views", KVViewsMode.parse(self.kv_views))
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = the process's setting), got {self.num_threads}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0 = the model's own), got {self.max_model_len}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {list(QUANT_MODES)}, got {self.quant!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.quant != "none" and (self.dtype != "float32" or self.device not in ("cpu", "auto")):
            raise ValueError(
                f"quant={self.quant} runs on the CPU with dtype float32 "
                f"(activations); got device {self.device!r}, dtype {self.dtype!r}"
            )


_ENDS = (ItemStatus.REJECTED, ItemStatus.FAILED)  # statuses that end the session on this worker


@record
class _Request:
    """A prefill or decode item, in the one shape admission needs."""

    out_index: int  # its place in the step's results
    session_id: str
    tokens: tuple[int, ...]
    start: int  # the position of its first token
    sample: bool  # sample after it (a decode, or a prompt's last chunk)
    sampling: SamplingSpec
    index: int  # generated_so_far, for seeded draws
    creates: bool  # may create the session (a prefill item at position 0)
    block_ids: tuple[int, ...] = ()
    cached: int = 0  # leading tokens already in the KV (prefix cache): not computed
    invalid: str = ""  # a problem found before the engine (see convert): REJECTED with it


@record
class _Admitted:
    """A request that passed admission, with its slice of the batch."""

    request: _Request
    run: RunItem
    cached: int = 0  # leading tokens of the chunk reused from the prefix cache, not run


def _requests(prefill: Sequence[PrefillItem], decode: Sequence[DecodeItem], last: Mapping[str, int]) -> list[_Request]:
    """The step's items as one list; a decode of the last sampled token reads it from ``last``
    (_NO_LAST when there is none: the item is then a CACHE_MISS)."""
    out = [
        _Request(
            i,
            p.session_id,
            tuple(p.token_ids),
            p.start_position,
            p.last_chunk,
            p.sampling,
            p.generated_so_far,
            True,
            tuple(p.block_ids),
            p.cached_tokens,
            p.invalid,
        )
        for i, p in enumerate(prefill)
    ]
    out += [
        _Request(
            len(prefill) + i,
            d.session_id,
            (last.get(d.session_id, _NO_LAST) if d.last_sampled else d.token_id,),
            d.position,
            True,
            d.sampling,
            d.generated_so_far,
            False,
            tuple(d.block_ids),
            invalid=d.invalid,
        )
        for i, d in enumerate(decode)
    ]
    return out


def _item_result(
    session_id: str, status: ItemStatus, sampled: Sampled | None, kv_tokens: int, cached_tokens: int, error: str
) -> ItemResult:
    if sampled is None:
        return ItemResult(session_id, status, None, kv_tokens, cached_tokens=cached_tokens, error=error)
    return ItemResult(
        session_id,
        status,
        sampled.token_id,
        kv_tokens,
        logprob=sampled.logprob,
        top_logprobs=sampled.top_logprobs,
        constraint_done=sampled.constraint_done,
        cached_tokens=cached_tokens,
    )


class Engine:
    def __init__(
        self,
        cfg: LlamaConfig,
        weights: Mapping[str, np.ndarray | BlockTensor],
        config: EngineConfig,
        *,
        constraint_factory: ConstraintFactory | None = None,
    ) -> None:
        self.cfg, self.config = cfg, config
        self.max_model_len = served_length(config.max_model_len, cfg)
        # Per-session token history and constraint state for the logit processors.
        self.sampling = SessionSampling(constraint_factory)
        self.device = resolve_device(config.device)
        self.dtype_name = config.dtype
        dtype = DTYPES[config.dtype]
        if config.quant != "none" and self.device.type != "cpu":
            raise ValueError(
                f"quant={config.quant} runs on the CPU; device {config.device!r} resolved to {self.device}"
            )
        self.quant = config.quant
        self.num_threads = config.num_threads or default_cpu_threads(
            cfg.hidden_size, cfg.intermediate_size, torch.get_num_threads()
        )
        # No second, [out, in] copy of the float32 weights for one-thread steps: on the Intel
        # Xeon (AVX-512) torch ran 2-12 rows 1.3-2.4x faster on the [in, out] copy it reads
        # transposed than on its own layout (issue 25: the weights live once).
        self.model = LlamaModel(
            cfg,
            weights,
            self.device,
            dtype,
            quant=config.quant,
            fused_ops=None if config.fused_ops else False,
            torch_copy=False,
            whole_steps=config.whole_steps,
        )
        self.use_threads()
        kv_dtype = kv_cache_dtype(self.device, dtype, config.quant, config.kv_dtype)
        self.cache = PagedKVCache(
            cfg.num_layers, config.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, self.device
        )
        # Both modes stay available so an experiment can switch the lever per step.
        self._views: dict[KVViewsMode, KVViews] = {mode: make_views(mode, self.cache) for mode in KVViewsMode}
        self.views = self._views[config.kv_views]
        # Each held session's block table (as the scheduler sent it) and tokens in the KV.
        self._tables: dict[str, list[int]] = {}
        self._held: dict[str, int] = {}
        # How many tables name each block (sessions share a cached prefix's blocks): the blocks in
        # use are its keys, kept as tables change rather than gathered from every table each step.
        self._block_refs: dict[int, int] = {}
        # Each held session's last sampled token: the input of a decode planned before it came
        # back to the scheduler (DecodeItem.last_sampled).
        self._last: dict[str, int] = {}
        self.kv_dtype_name = str(kv_dtype).removeprefix("torch.")  # GetInfo's kv_dtype
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(kv_dtype.itemsize)
        self.capacity_tokens = config.num_blocks * config.block_size
        self.parameter_count, self.weight_bytes = self.model.sizes()
        self._counts = {
            "steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "cache_misses": 0,
            "item_errors": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
        }

    def use_threads(self, n: int = 0) -> None:
        """(Re)claim the process's CPU threads for this engine: ``n``, or its configured count
        (a process-wide setting; for benchmarks that alternate engines in one process)."""
        if self.model.plan.on_cpu:
            use_cpu_threads(n or self.num_threads, self.model.host_blas, self.model)

    # -- validation and admission ------------------------------------------------------------

    @staticmethod
    def _check_step(requests: Sequence[_Request]) -> None:
        """ValueError for a step no worker could run: it names a session twice."""
        seen: set[str] = set()
        for r in requests:
            if r.session_id in seen:
                raise ValueError(f"session {r.session_id!r} appears more than once in one step")
            seen.add(r.session_id)

    def _problem(self, r: _Request) -> str:
        """Why this worker cannot run the item as sent ("" if it can)."""
        if r.invalid:
            return r.invalid
        tokens, start = r.tokens, r.start
        if not tokens:
            return "empty prefill chunk"
        if start < 0:
            return f"negative position {start}"
        if start + len(tokens) > self.max_model_len:
            return (
                f"positions up to {start + len(tokens)} exceed the served context of {self.max_model_len} tokens "
                f"(max_model_len; the model's max_position is {self.cfg.max_position})"
            )
        bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size][:8]
        if bad:
            return f"token ids {bad} outside vocab_size {self.cfg.vocab_size}"
        try:
            self.sampling.check(r.sampling, self.cfg.vocab_size)
        except ValueError as exc:
            return str(exc)
        return ""

    def _blocks_problem(self, r: _Request, held: Sequence[int]) -> str:
        """Why the session's blocks (``held``, then the item's new ones) cannot hold the item ("" if
        they can). Only the new ids are checked against the table: a decode brings none, mostly."""
        new = r.block_ids
        if new:
            bad = [b for b in new if not 0 <= b < self.config.num_blocks][:8]
            if bad:
                return f"block ids {bad} outside the cache's {self.config.num_blocks} blocks"
            if len(set(new)) != len(new) or not set(new).isdisjoint(held):
                return "the session's block table names a block twice"
        need, room = r.start + len(r.tokens), (len(held) + len(new)) * self.config.block_size
        if room < need:
            return (
                f"the session's {len(held) + len(new)} blocks of {self.config.block_size} cannot hold "
                f"{need} tokens: the scheduler's block table is behind"
            )
        if not 0 <= r.cached < len(r.tokens):
            return f"cached_tokens {r.cached} must leave at least one of the chunk's {len(r.tokens)} tokens to compute"
        return ""

    def _admit(self, r: _Request) -> _Admitted | tuple[ItemStatus, str]:
        sid = r.session_id
        if sid in self._held:
            miss = self._held[sid] != r.start  # also a second "first chunk"
        else:
            miss = not (r.creates and r.start == 0)  # only a first prefill chunk creates
        if miss:
            self._counts["cache_misses"] += 1
            return ItemStatus.CACHE_MISS, ""
        table = self._tables.get(sid, [])
        problem = self._blocks_problem(r, table)
        if problem:
            return ItemStatus.FAILED, problem
        table.extend(r.block_ids)  # (in place: a decode's table is not copied every step)
        refs = self._block_refs
        for b in r.block_ids:
            refs[b] = refs.get(b, 0) + 1
        self._tables[sid] = table
        self._held[sid] = r.start + len(r.tokens)
        bs, first = self.config.block_size, r.start + r.cached
        slots = tuple(table[p // bs] * bs + p % bs for p in range(first, r.start + len(r.tokens)))
        # Attention reads only the blocks written so far (a table may reserve more ahead).
        blocks = tuple(table[: -(-self._held[sid] // bs)])
        run = RunItem(sid, r.tokens[r.cached :], first, slots, blocks, r.sample)
        return _Admitted(r, run, r.cached)

    # -- the step ----------------------------------------------------------------------------

    def step(
        self,
        prefill: Sequence[PrefillItem],
        decode: Sequence[DecodeItem],
        *,
        return_logits: bool = False,
        kv_views: KVViewsMode | str | None = None,
    ) -> StepOutput:
        """Run every admissible item in one batched forward; see the module docstring.

        kv_views overrides the configured mode for this step (a mode, or the string naming one;
        None or "" = the configured one).
        """
        t_start = time.perf_counter_ns()
        views = self._views[KVViewsMode.parse(kv_views)] if kv_views else self.views
        requests = _requests(prefill, decode, self._last)
        self._check_step(requests)
        admitted: list[_Admitted] = []
        failed: dict[int, tuple[ItemStatus, str]] = {}  # by output index: (status, error)
        for r in requests:
            if r.tokens and r.tokens[-1] == _NO_LAST:  # a decode of a last sampled token this engine lacks
                self._counts["cache_misses"] += 1
                failed[r.out_index] = (ItemStatus.CACHE_MISS, "")
                continue
            problem = self._problem(r)
            got = (ItemStatus.REJECTED, problem) if problem else self._admit(r)
            if isinstance(got, _Admitted):
                admitted.append(got)
            else:
                failed[r.out_index] = got

        times = PhaseTimes()
        tokens: dict[int, Sampled] = {}
        logits_out = np.full((len(requests), self.cfg.vocab_size), np.nan, np.float32) if return_logits else None
        sync_ns = 0
        if admitted:
            sync = not self.model.plan.on_cpu and self.config.profile_sync
            try:
                failpoints.check("worker.forward", [a.request.sampling.seed for a in admitted])
                logits = run_step(
                    self.model, self.cache, views, [a.run for a in admitted], times, sync=sync
                )  # [N, V] on device
            except BaseException:
                # The books already hold these tokens but the cache may not: drop the sessions
                # so that their next request is a clean CACHE_MISS, not silently wrong KV.
                self.release(a.run.session_id for a in admitted)
                raise
            for a in admitted:
                self.sampling.feed(a.request.session_id, a.request.tokens, a.request.start)
            sampled = [a.request for a in admitted if a.run.sample]
            sync_ns = self._sample(sampled, logits, tokens, logits_out, failed)
            for r in sampled:
                if r.out_index in tokens:
                    self._last[r.session_id] = tokens[r.out_index].token_id
            chunks = sum(len(a.request.tokens) for a in admitted if a.request.creates)
            self._counts["prefill_tokens"] += chunks
            if self.config.prefix_caching:
                self._counts["prefix_cache_queries"] += chunks
                self._counts["prefix_cache_hits"] += sum(a.cached for a in admitted)
            self._counts["decode_tokens"] += sum(1 for a in admitted if not a.request.creates)
        self._counts["steps"] += 1
        # A rejected or failed item ends its session: free it now, so that nothing here waits
        # on the scheduler's release to be right.
        ended = [r.session_id for r in requests if failed.get(r.out_index, (ItemStatus.OK,))[0] in _ENDS]
        if ended:
            self.release(ended)
            self._counts["item_errors"] += len(ended)

        cached = {a.request.out_index: a.cached for a in admitted}  # reused from the prefix cache
        results = [
            _item_result(
                r.session_id,
                failed.get(r.out_index, (ItemStatus.OK, ""))[0],
                None if r.out_index in failed else tokens.get(r.out_index),
                self._held.get(r.session_id, 0),
                cached.get(r.out_index, 0),
                failed.get(r.out_index, (ItemStatus.OK, ""))[1],
            )
            for r in requests
        ]
        profile = StepProfile(
            kv_view_prepare_ns=times.kv_view_prepare_ns,
            attention_ns=times.attention_ns,
            step_ns=time.perf_counter_ns() - t_start,
            post_step_sync_ns=sync_ns,
            kv_write_ns=times.kv_write_ns,
        )
        return StepOutput(results, profile, logits_out)

    def _sample(
        self,
        sampled: list[_Request],
        logits: torch.Tensor,
        tokens: dict[int, Sampled],
        logits_out: np.ndarray | None,
        failed: dict[int, tuple[ItemStatus, str]],
    ) -> int:
        """Fill ``tokens`` (by output index) from logits [N, V]; returns the sync time in ns.
        A row whose sampling raises fails alone: its error goes into ``failed``.

        Plain greedy rows are reduced on the device so that only N ints cross to the host; only
        the rows that need processing (temperature, penalties, bias, a constraint, logprobs)
        come over, unless the caller wants every row's logits.
        """
        if not sampled:
            return 0
        t0 = time.perf_counter_ns()
        synchronize(self.device)
        greedy = torch.argmax(logits, dim=-1).tolist()
        rows = [row for row, r in enumerate(sampled) if r.sampling.needs_host]
        host: dict[int, torch.Tensor] = {}
        if logits_out is not None:
            host = dict(enumerate(logits.cpu()))
        elif rows:
            host = dict(zip(rows, logits[rows].cpu()))
        sync_ns = time.perf_counter_ns() - t0
        for row, r in enumerate(sampled):
            if r.sampling.needs_host:
                try:
                    tokens[r.out_index] = self.sampling.sample(r.session_id, host[row], r.sampling, r.index)
                except ConstraintRefused as exc:
                    failed[r.out_index] = (ItemStatus.REJECTED, str(exc))
                except Exception as exc:  # a fault of this item's sampling, not of the step
                    failed[r.out_index] = (ItemStatus.FAILED, f"sampling failed: {type(exc).__name__}: {exc}")
            else:
                tokens[r.out_index] = Sampled(greedy[row])
            if logits_out is not None:
                logits_out[r.out_index] = host[row].numpy()
        return sync_ns

    # -- lifetime ----------------------------------------------------------------------------

    def release(self, session_ids: Iterable[str]) -> int:
        """Drop sessions (their tables, sampling state and persistent views); unknown ids are
        ignored. Their blocks are the scheduler's to hand out again."""
        held = 0
        for sid in session_ids:
            if self._held.pop(sid, None) is not None:
                held += 1
            refs = self._block_refs
            for b in self._tables.pop(sid, ()):
                if refs[b] == 1:
                    del refs[b]
                else:
                    refs[b] -= 1
            self._last.pop(sid, None)
            self.sampling.forget(sid)
            for views in self._views.values():
                views.release(sid)
        return held

    def reset(self) -> int:
        """Drop every session: the scheduler's books for this worker start empty (it started, or
        took this worker back after losing it). Returns how many were held."""
        return self.release(list(self._held))

    def session_ids(self) -> list[str]:
        return list(self._held)

    def stats(self) -> EngineStats:
        c = self._counts
        used = len(self._block_refs)
        return EngineStats(
            steps=c["steps"],
            prefill_tokens=c["prefill_tokens"],
            decode_tokens=c["decode_tokens"],
            cache_misses=c["cache_misses"],
            active_sessions=len(self._held),
            used_blocks=used,
            free_blocks=self.config.num_blocks - used,
            item_errors=c["item_errors"],
            prefix_cache_queries=c["prefix_cache_queries"],
            prefix_cache_hits=c["prefix_cache_hits"],
        )
