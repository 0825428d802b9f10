#!/usr/bin/env bash
# Fetch NVIDIA's own nvidia-cuda-mps-control (Debian non-free `nvidia-cuda-mps`) so the MPS tests can
# run against the real daemon as well as the stand-in. The daemon starts and answers control commands
# on a machine without a GPU as long as no CUDA client connects (docs/sharing.md, "NVIDIA's daemon,
# as measured").
#
# Unpacked, never installed: each build goes to .cache/nvidia-mps/<version>/ (git-ignored) with
# `dpkg -x`. apt runs with a private configuration (its own sources file, lists and cache under
# .cache/nvidia-mps/apt), so the system's apt sources and state are never touched and root is not needed.
#
# Never fails the caller: without network or apt it says so on one line and exits 0; the real-daemon
# tests then skip with that reason (tests/support/mpsdaemons.py looks for the unpacked builds).
set -uo pipefail
cd "$(dirname "$0")/.."
dest=.cache/nvidia-mps
apt_dir=$dest/apt
# suite -> the driver series it carries (550.x in trixie, 535.x in bookworm).
suites=(trixie bookworm)

say() { echo "fetch-nvidia-mps: $*"; }

if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  say "SKIPPED: apt-get/dpkg not available; real-daemon MPS tests will skip"
  exit 0
fi
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
if [ ! -r "$keyring" ]; then
  say "SKIPPED: $keyring not readable; real-daemon MPS tests will skip"
  exit 0
fi
arch=$(dpkg --print-architecture)
if [ "$arch" != amd64 ] && [ "$arch" != arm64 ]; then
  say "SKIPPED: no nvidia-cuda-mps build for $arch; real-daemon MPS tests will skip"
  exit 0
fi

# Already fetched: one unpacked build per suite is enough.
have=0
for suite in "${suites[@]}"; do
  if [ -n "$(find "$dest" -maxdepth 1 -name "*+$suite" -print -quit 2>/dev/null)" ]; then
    have=$((have + 1))
  fi
done
if [ "$have" -eq "${#suites[@]}" ]; then
  say "already present: $(cd "$dest" && ls -d -- *+* | tr '\n' ' ')"
  exit 0
fi

mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/etc"
: > "$apt_dir/etc/sources.list"
for suite in "${suites[@]}"; do
  echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite non-free" >> "$apt_dir/etc/sources.list"
done
abs_apt=$(cd "$apt_dir" && pwd)
apt_opts=(
  -o "Dir::Etc::SourceList=$abs_apt/etc/sources.list"
  -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$abs_apt/lists"
  -o "Dir::Cache=$abs_apt/cache"
  -o Dir::Etc::Preferences=/dev/null
  -o Dir::Etc::PreferencesParts=/dev/null
  -o "APT::Architecture=$arch"
  -o Acquire::Retries=1
  -o Acquire::http::Timeout=20
  -o Debug::NoLocking=1
  # Downloads run as whoever runs this (no switch to _apt), so it works without root.
  -o "APT::Sandbox::User=$(id -un)"
)

if ! timeout 180 apt-get "${apt_opts[@]}" -q update >"$apt_dir/update.log" 2>&1; then
  say "SKIPPED: apt-get update failed (no network?); real-daemon MPS tests will skip. See $apt_dir/update.log"
  exit 0
fi

# apt-get update exits 0 even when every download failed: look for the lists themselves.
if [ -z "$(find "$apt_dir/lists" -maxdepth 1 -name '*_Packages*' -print -quit)" ]; then
  say "SKIPPED: could not download Debian's package lists (no network?); real-daemon MPS tests will skip." \
    "$(grep -m1 -E '^(W|E):' "$apt_dir/update.log" || true)"
  exit 0
fi

fetched=0
for suite in "${suites[@]}"; do
  # The candidate in this suite's own list; apt's default pick would be the newest across suites.
  version=$(apt-cache "${apt_opts[@]}" madison nvidia-cuda-mps 2>/dev/null \
    | awk -v s="$suite" '$0 ~ " "s"/" {print $3; exit}')
  if [ -z "$version" ]; then
    say "no nvidia-cuda-mps in $suite non-free for $arch"
    continue
  fi
  out="$dest/$version+$suite"
  if [ -x "$out/usr/bin/nvidia-cuda-mps-control" ]; then
    fetched=$((fetched + 1))
    continue
  fi
  work=$(mktemp -d)
  if (cd "$work" && timeout 300 apt-get "${apt_opts[@]}" -q download "nvidia-cuda-mps=$version") >"$apt_dir/download-$suite.log" 2>&1; then
    rm -rf "$out.tmp" && mkdir -p "$out.tmp"
    if dpkg -x "$work"/nvidia-cuda-mps_*.deb "$out.tmp" && [ -x "$out.tmp/usr/bin/nvidia-cuda-mps-control" ]; then
      rm -rf "$out" && mv "$out.tmp" "$out"
      say "unpacked nvidia-cuda-mps $version ($suite) into $out"
      fetched=$((fetched + 1))
    else
      rm -rf "$out.tmp"
      say "could not unpack nvidia-cuda-mps $version ($suite)"
    fi
  else
    say "download of nvidia-cuda-mps $version ($suite) failed; see $apt_dir/download-$suite.log"
  fi
  rm -rf "$work"
done
if [ "$fetched" -eq 0 ]; then
  say "SKIPPED: no build fetched; real-daemon MPS tests will skip"
fi
exit 0
