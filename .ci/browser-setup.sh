#!/usr/bin/env bash
# Install what tests/browser/test_browser.py needs beyond requirements.txt: Debian's Chromium (the test
# launches /usr/bin/chromium through the playwright Python package; Playwright's own browser download
# needs network access CI does not have) and fonts for readable screenshots, Noto CJK for the Chinese edition's
# plots and pages (matplotlib picks it through course_utils.i18n). Idempotent; needs root
# (or sudo) and the Debian package mirror.
set -euo pipefail

packages=(chromium fonts-dejavu-core fonts-liberation fonts-noto-cjk)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ] && [ -x /usr/bin/chromium ]; then
    echo "browser-setup: ${packages[*]} already installed"
    exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "browser-setup: need root (or sudo) to apt-get install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q "${missing[@]}"  # with recommends: the combination the test was developed with
/usr/bin/chromium --version
