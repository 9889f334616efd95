# Sourced by scripts/*: make sure .venv exists and holds pdd with the given extras.
# Usage: ensure_venv [extras]   e.g. ensure_venv test,nixl
# Re-installs only when setup.cfg changed since the last install (stamp file).

# The torch every install of pdd gets unless told otherwise: the CPU build of
# 2.13.0 is what this project's CI machines carry. On a GPU host pip's index
# decides the build (PyPI's Linux wheels are CUDA builds); PDD_TORCH_VERSION
# picks another version, PIP_INDEX_URL another index (PyTorch's per-CUDA ones).
torch_requirement() {
    echo "torch==${PDD_TORCH_VERSION:-2.13.0}"
}

ensure_venv() {
    local extras="${1:-}"
    local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    local venv="$root/.venv"
    local py="${PYTHON:-python3}"
    if [ ! -x "$venv/bin/python" ]; then
        "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
            echo "pdd needs Python >= 3.11 (found $("$py" --version 2>&1))" >&2; return 1; }
        "$py" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
    fi
    # torch first and pinned (torch_requirement): an unpinned torch pulls the
    # newest multi-GB CUDA build. Extras that depend on an unpinned torch (nixl)
    # then find it installed and keep it.
    if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
        "$venv/bin/python" -m pip install -q "$(torch_requirement)"
    fi
    local spec="$root"; [ -n "$extras" ] && spec="$root[$extras]"
    local stamp="$venv/.pdd-installed-${extras:-base}"
    local want; want="$(cat "$root/setup.cfg" "$root/pyproject.toml" | sha256sum | cut -c1-16)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        "$venv/bin/python" -m pip install -q -e "$spec"
        echo "$want" > "$stamp"
    fi
    export PATH="$venv/bin:$PATH"
}
