"""Debian's Chromium, headless, as the browser tests drive it through Playwright (never a
browser download: `make test` installs the package)."""

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
