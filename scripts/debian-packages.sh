# debian-packages.sh - sourced (not run) by the scripts that build or
# install with Debian's packages: which of some packages are not installed,
# installing those, and the kernel package linux-image-amd64 stands for.
#
# Owns nothing of its own.  It must never install a package it was not
# asked for, and says nothing on stdout (its callers print their results
# there).

# Prints, one a line, those of the packages named that are not installed.
missing_packages() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

# Installs those of the packages named that are not installed (needs root).
install_packages() {
  local missing
  mapfile -t missing < <(missing_packages "$@")
  [ ${#missing[@]} -gt 0 ] || return 0
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
}

# Prints the versioned package of Debian's current kernel
# (linux-image-6.1.0-N-amd64), updating apt's lists once where they do
# not know it.
debian_kernel_package() {
  local k
  k=$(apt-cache depends linux-image-amd64 2>/dev/null |
      awk '/Depends: linux-image-[0-9]/ {print $2; exit}' || true)
  if [ -z "$k" ]; then
    apt-get update -qq >&2
    k=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  fi
  echo "$k"
}
