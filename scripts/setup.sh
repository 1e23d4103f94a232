#!/usr/bin/env bash
# Installs what moe.c needs to build and test on Debian/Ubuntu: a C compiler with OpenMP, make,
# the jansson JSON library, and Open MPI (several ranks). Safe to run again.
set -euo pipefail
packages=(build-essential libjansson-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
