#!/usr/bin/env bash
# Make a development CA and certificates for kvfleet's TLS / mutual TLS. Not for production:
# the CA key sits next to the certificates, and nothing is ever rotated.
#
#   deploy/tls/make_dev_certs.sh OUT_DIR [EXTRA_SAN,...]
#
# Writes ca.pem, and for each identity NAME.pem / NAME.key:
#   scheduler  CN kvfleet-scheduler  server + client (it is the workers' client)
#   worker     CN kvfleet-worker     server + client (it exports spans to telemetry)
#   telemetry  CN kvfleet-telemetry  server + client (its own TLS healthcheck)
#   gateway    CN kvfleet-gateway    client (of the scheduler and telemetry)
#   client     CN kvfleet-client     client (a user of the scheduler's API)
# Server certificates name localhost, 127.0.0.1, the compose service names and any EXTRA_SANs.
# Keys are mode 600; KVFLEET_KEY_MODE=644 makes them readable by the containers' own user (uid
# 10001) when the folder is mounted into the compose stack (docker-compose.tls.yml).
set -euo pipefail
out=${1:?usage: make_dev_certs.sh OUT_DIR [EXTRA_SAN,...]}
extra=${2:-}
mkdir -p "$out"
cd "$out"
days=825

openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days "$days" \
  -subj "/CN=kvfleet development CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

sans="DNS:localhost,IP:127.0.0.1,DNS:scheduler,DNS:telemetry,DNS:gateway,DNS:worker,DNS:worker-0,DNS:worker-1"
sans+=",DNS:kvfleet-scheduler,DNS:kvfleet-telemetry,DNS:kvfleet-worker-0.kvfleet-worker,DNS:kvfleet-worker-1.kvfleet-worker"
for s in ${extra//,/ }; do
  case "$s" in
    *[!0-9.]*) sans+=",DNS:$s" ;;
    *) sans+=",IP:$s" ;;
  esac
done

issue() {  # name cn usage
  local name=$1 cn=$2 usage=$3 ext
  ext=$(mktemp)
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
    "$usage" "$sans" > "$ext"
  openssl req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "/CN=$cn" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$name.pem" \
    -days "$days" -extfile "$ext" 2>/dev/null
  rm -f "$name.csr" "$ext"
}
issue scheduler kvfleet-scheduler serverAuth,clientAuth
issue worker kvfleet-worker serverAuth,clientAuth      # a client of telemetry (OTLP)
issue telemetry kvfleet-telemetry serverAuth,clientAuth   # a client of itself in its healthcheck
issue gateway kvfleet-gateway clientAuth
issue client kvfleet-client clientAuth
chmod "${KVFLEET_KEY_MODE:-600}" ./*.key
echo "certificates in $out: ca.pem and scheduler, worker, telemetry, gateway, client (.pem/.key)"
