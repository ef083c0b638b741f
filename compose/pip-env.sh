# Sourced by compose/Dockerfile's pip steps: the pip build arguments as pip's own variables, only
# those that are set (pip reads an empty PIP_INDEX_URL as an empty index, not as "the default").
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do
  eval "val=\${$v:-}"
  if [ -n "$val" ]; then export "$v=$val"; else unset "$v"; fi
done
if [ -n "${CA_BUNDLE:-}" ]; then
  # a file name in compose/certs/ (copied to /etc/zeroserve/certs/); a missing one stops the build
  PIP_CERT="/etc/zeroserve/certs/$(basename "$CA_BUNDLE")"
  [ -f "$PIP_CERT" ] || { echo "CA_BUNDLE=$CA_BUNDLE: no such file in compose/certs/" >&2; exit 1; }
  export PIP_CERT
fi
