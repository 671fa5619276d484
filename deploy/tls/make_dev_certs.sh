#!/usr/bin/env bash
# Make a development CA and certificates for kvfleet's TLS / mutual TLS. Not for production:
# nothing is ever rotated.
#
#   deploy/tls/make_dev_certs.sh OUT_DIR [SERVICE=NAME ...]
#
# One folder per identity, the only thing that service mounts (docker-compose.tls.yml):
#   scheduler/  CN kvfleet-scheduler  server + client (it is the workers' client)
#   worker/     CN kvfleet-worker     server + client (it exports spans to telemetry)
#   telemetry/  CN kvfleet-telemetry  server + client (its own TLS healthcheck)
#   gateway/    CN kvfleet-gateway    client (of the scheduler and telemetry)
#   client/     CN kvfleet-client     client (a user of the scheduler's API)
# each holding ca.pem, NAME.pem and NAME.key. The CA's key, ca.key, stays in OUT_DIR itself and in
# no service folder: whoever holds it can mint any identity. OUT_DIR also has ca.pem and links
# NAME.pem / NAME.key to the folders, for processes on this host (kvfleet up, tests).
#
# A server certificate names localhost and 127.0.0.1 (each container's own healthcheck) and its
# own service only: scheduler, worker-0/1 (and kvfleet-worker-N.kvfleet-worker), telemetry, so
# the worker's key cannot pass for the scheduler, nor the telemetry's for a worker.
# SERVICE=NAME adds a name (a host or an IP) to that service's certificate, e.g. worker=hostA.
#
# Keys are mode 600. For the compose stack, whose containers run as uid 10001, either run this as
# root with KVFLEET_KEY_OWNER=10001 (the service folders' keys then belong to that uid) or, for a
# throwaway development folder, KVFLEET_KEY_MODE=644. ca.key is mode 600 whatever they say.
set -euo pipefail
usage="usage: make_dev_certs.sh OUT_DIR [scheduler|worker|telemetry=NAME ...]"
out=${1:?$usage}
shift
declare -A sans=(
  [scheduler]="DNS:scheduler,DNS:kvfleet-scheduler"
  [worker]="DNS:worker,DNS:worker-0,DNS:worker-1,DNS:kvfleet-worker-0.kvfleet-worker,DNS:kvfleet-worker-1.kvfleet-worker"
  [telemetry]="DNS:telemetry,DNS:kvfleet-telemetry"
)
for arg in "$@"; do
  service=${arg%%=*} name=${arg#*=}
  if [[ "$arg" != *=* || -z "$name" || -z "${sans[$service]:-}" ]]; then
    echo "make_dev_certs.sh: '$arg' names no server certificate; $usage" >&2
    exit 2
  fi
  case "$name" in
    *[!0-9.]*) sans[$service]+=",DNS:$name" ;;
    *) sans[$service]+=",IP:$name" ;;
  esac
done
mkdir -p "$out"
cd "$out"
days=825

(umask 077 && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days "$days" \
  -subj "/CN=kvfleet development CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null)
chmod 600 ca.key
chmod 644 ca.pem

issue() {  # name cn usage
  local name=$1 cn=$2 usage=$3 ext
  ext=$(mktemp)
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\n' \
    "$usage" > "$ext"
  if [[ -n "${sans[$name]:-}" ]]; then   # a server: loopback for its healthcheck, then its own names
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1,%s\n' "${sans[$name]}" >> "$ext"
  fi
  mkdir -p "$name"
  (umask 077 && openssl req -newkey rsa:2048 -nodes -keyout "$name/$name.key" -out "$name.csr" \
    -subj "/CN=$cn" 2>/dev/null)
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$name/$name.pem" \
    -days "$days" -extfile "$ext" 2>/dev/null
  cp ca.pem "$name/ca.pem"
  chmod 644 "$name/ca.pem" "$name/$name.pem"
  chmod "${KVFLEET_KEY_MODE:-600}" "$name/$name.key"
  chmod 755 "$name"
  if [[ -n "${KVFLEET_KEY_OWNER:-}" ]]; then
    chown "$KVFLEET_KEY_OWNER" "$name/$name.key"
  fi
  ln -sf "$name/$name.pem" "$name.pem"
  ln -sf "$name/$name.key" "$name.key"
  rm -f "$name.csr" "$ext"
}
issue scheduler kvfleet-scheduler serverAuth,clientAuth
issue worker kvfleet-worker serverAuth,clientAuth      # a client of telemetry (OTLP)
issue telemetry kvfleet-telemetry serverAuth,clientAuth   # a client of itself in its healthcheck
issue gateway kvfleet-gateway clientAuth
issue client kvfleet-client clientAuth
rm -f ca.srl
echo "certificates in $out: ca.pem (ca.key stays here) and scheduler/, worker/, telemetry/, gateway/, client/"
