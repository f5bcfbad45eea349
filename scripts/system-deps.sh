#!/usr/bin/env bash
# System packages the framework uses when present. bubblewrap gives LocalSubprocessSandbox
# its namespace isolation; without it the sandbox degrades to resource limits only (and says
# so loudly). Installed with apt when running as root on Debian/Ubuntu; otherwise a notice.
set -u
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${missing[*]}"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || echo "warning: could not install ${missing[*]}; the sandbox will run without namespace isolation" >&2
else
  echo "notice: ${missing[*]} not installed (needs root + apt); the sandbox will run without namespace isolation" >&2
fi
exit 0
