#!/usr/bin/env bash
# What the web-app browser tests (tests/ui/test_web.py) need on a fresh Debian machine:
# Debian's chromium, driven by playwright-python (its own browser downloads are never used),
# and the Gradio extra. Idempotent: each step is skipped when its part is already there.
# Run it with the project's virtual environment active (python = the venv's python).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python}

if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        apt_get="apt-get"
    elif command -v sudo >/dev/null 2>&1; then
        apt_get="sudo apt-get"
    else
        echo "browser.sh: chromium is missing and neither root nor sudo is available to install it" >&2
        exit 1
    fi
    echo "browser.sh: installing chromium" >&2
    $apt_get update -qq
    DEBIAN_FRONTEND=noninteractive $apt_get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi

if ! "$python" -c "import playwright, gradio" >/dev/null 2>&1; then
    echo "browser.sh: installing playwright and gradio" >&2
    "$python" -m pip install --quiet "playwright>=1.45,<2" "gradio>=5,<7"
fi
