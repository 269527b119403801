#!/bin/sh
# Make the virtualenv $1 with the base image's Python 3.11+: the one the image has
# (python:3.11-slim), else Debian's (bookworm: 3.11), installed here with venv support.
# Extra Debian packages to install go in $2 (space separated). Used by the Dockerfiles in
# this repository, so that every image builds on a public Python image and on a bare Debian.
set -eu
venv="$1"
packages="${2:-}"
if ! command -v python3 >/dev/null || ! python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  packages="python3 python3-venv $packages"
fi
if [ -n "$packages" ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages
  rm -rf /var/lib/apt/lists/*
fi
python3 -m venv "$venv"
"$venv/bin/python" -c 'import sys; print("python", sys.version.split()[0], "in", sys.prefix)'
