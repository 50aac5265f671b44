"""Browser check of the built book: every page opened in headless Chromium, offline.

    python tools/site_check.py                 # build the site, check every page
    python tools/site_check.py ch07 ch09       # only the pages whose name starts so
    python tools/site_check.py --no-build ch07 # reuse the last build (site-check/site/)

It builds the site with `mkdocs build` into site-check/site/, serves it on 127.0.0.1 and opens each
page in the system's Chromium (Debian: `apt-get install chromium fonts-noto-cjk`) through
Playwright (`pip install -c constraints.txt -e '.[site]'`). A page fails when

- a mermaid block did not become an SVG (or became mermaid's error picture),
- the page logs a JavaScript error (console error, uncaught exception, failed request),
- a code block is empty (an include that came out empty) or is nothing but include lines,
- a code block's long lines are cut off instead of scrolling,
- a diagram was shrunk to fit the column so far that its text is smaller than 11 px
  (--min-text-px): such a diagram needs shorter lines or another direction,
- the page asks for anything not on 127.0.0.1 (the book must read offline; such requests are
  blocked).

It prints one line per page and saves under site-check/ a full-page screenshot per page
(<page>.png) and one picture per diagram (<page>.mermaid-<n>.png) to look at. Exit status 1 when
any page failed. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

try:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright
except ImportError:  # reported in main()
    sync_playwright = None
    PlaywrightError = Exception

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "site-check"

# Outside requests that are blocked but do not fail a page: material's header asks GitHub's API for
# the repository's stars and forks (repo_url in mkdocs.yml) and shows the plain link without them.
TOLERATED = re.compile(r"https://api\.github\.com/repos/")

# Closed shadow roots (material puts each diagram's SVG in one) are opened for the check only, so
# that the SVG can be found.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
  return attach.call(this, Object.assign({}, init, {mode: "open"}));
};
"""

# True once material has replaced every mermaid block by a diagram with an SVG (arg: how many).
ALL_DRAWN = """
n => document.querySelectorAll("pre.mermaid").length === 0 &&
  [...document.querySelectorAll("div.mermaid")]
    .filter(d => d.shadowRoot && d.shadowRoot.querySelector("svg")).length >= n
"""

# Counts what a page shows once its scripts ran.
INSPECT = r"""
() => {
  const diagrams = [...document.querySelectorAll("div.mermaid")];
  const svgs = diagrams.map(d => d.shadowRoot && d.shadowRoot.querySelector("svg"));
  const codes = [...document.querySelectorAll(".md-content pre > code")];
  const clipped = [], scrolling = [];
  codes.forEach((c, i) => {
    if (c.scrollWidth > c.clientWidth + 1) {
      const ox = getComputedStyle(c).overflowX;
      const visible = c.offsetHeight - c.clientHeight > 0 || ox === "scroll";
      (ox === "auto" || ox === "scroll") && visible ? scrolling.push(i) : clipped.push(i);
    }
  });
  // The size, in screen pixels, at which most of each diagram's text is shown: its font size
  // times the factor by which the SVG was shrunk to fit the column.
  const text_px = svgs.filter(s => s).map(s => {
    const vb = s.viewBox && s.viewBox.baseVal;
    const scale = vb && vb.width ? Math.min(1, s.getBoundingClientRect().width / vb.width) : 1;
    const sizes = [];
    s.querySelectorAll("*").forEach(el => {
      const own = [...el.childNodes].filter(n => n.nodeType === 3).map(n => n.data).join("").trim();
      if (own) sizes.push([parseFloat(getComputedStyle(el).fontSize) * scale, own.length]);
    });
    sizes.sort((a, b) => a[0] - b[0]);
    let half = sizes.reduce((n, x) => n + x[1], 0) / 2;
    for (const [px, n] of sizes) if ((half -= n) <= 0) return px;
    return 0;
  });
  return {
    text_px: text_px,
    pending: document.querySelectorAll("pre.mermaid").length,
    rendered: svgs.filter(s => s && s.getAttribute("aria-roledescription") !== "error").length,
    errors: svgs.filter(s => s && s.getAttribute("aria-roledescription") === "error").length,
    empty_code: codes.filter(c => !c.closest(".mermaid") && c.textContent.trim() === "").length,
    include_lines: codes.filter(c => {
      const lines = c.textContent.split("\n").filter(l => l.trim());
      return lines.length > 0 && lines.every(l => /^\s*--8<--\s+"[^"]*"\s*$/.test(l));
    }).length,
    clipped: clipped.length,
    scrolling: scrolling.length,
  };
}
"""


def build(site: Path) -> None:
    """mkdocs build (strict, as mkdocs.yml says) into `site`."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--quiet", "--clean", "--site-dir", str(site)]
    result = subprocess.run(cmd, cwd=ROOT, env=env)
    if result.returncode != 0:
        sys.exit(f"mkdocs build failed ({result.returncode})")


def pages_of(site: Path, wanted: list[str]) -> list[str]:
    """Site-relative URLs of the book's pages ('' for the front page), filtered by `wanted`."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        if rel.split("/")[0] in ("assets", "search"):
            continue
        pages.append("" if rel == "." else rel + "/")
    if not wanted:
        return pages
    keys = [Path(w).name.removesuffix(".md").removesuffix("index") for w in wanted]
    chosen = [p for p in pages if any(p.startswith(k) if k else p == "" for k in keys)]
    if not chosen:
        sys.exit(f"no page matches {wanted}; pages: {pages}")
    return chosen


def expected_diagrams(site: Path, page: str) -> int:
    text = (site / page / "index.html").read_text(encoding="utf-8")
    return len(re.findall(r'<pre class="mermaid">', text))


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def one_line(text: str) -> str:
    return " ".join(text.split())[:200]


def is_local(url: str) -> bool:
    return urlsplit(url).hostname == "127.0.0.1" or url.startswith(("data:", "blob:", "about:"))


def shot_name(page: str) -> str:
    return page.strip("/").replace("/", "_") or "index"


def find_chromium(given: str | None) -> str:
    names = ("chromium", "chromium-browser", "google-chrome")
    for cand in (given, os.environ.get("CHROMIUM"), *names):
        if cand and (path := shutil.which(cand)):
            return path
    sys.exit("no Chromium found: apt-get install chromium fonts-noto-cjk (or --chromium PATH)")


def check_page(
    context, base: str, page: str, n_expected: int, shots: Path, min_text_px: float
) -> tuple[str, list[str]]:
    errors: list[str] = []
    browser_page = context.new_page()

    def on_console(msg) -> None:
        # A blocked outside request also logs a console error; it is reported as a request.
        if msg.type == "error" and is_local(msg.location.get("url") or base):
            errors.append(f"console: {one_line(msg.text)}")

    browser_page.on("console", on_console)
    browser_page.on("pageerror", lambda e: errors.append(f"pageerror: {one_line(str(e))}"))
    browser_page.on(
        "requestfailed",
        lambda r: is_local(r.url) and errors.append(f"request failed: {r.url} {r.failure}"),
    )
    browser_page.goto(base + page, wait_until="load")
    try:
        browser_page.wait_for_function(ALL_DRAWN, arg=n_expected, timeout=30_000)
    except PlaywrightError:  # a timeout is reported through the counts below
        pass
    browser_page.evaluate("document.fonts.ready")
    browser_page.wait_for_timeout(300)
    found = browser_page.evaluate(INSPECT)
    if found["rendered"] != n_expected:
        errors.append(f"{found['rendered']} of {n_expected} mermaid blocks became an SVG")
    if found["errors"]:
        errors.append(f"{found['errors']} mermaid error picture(s)")
    if found["empty_code"]:
        errors.append(f"{found['empty_code']} empty code block(s)")
    if found["include_lines"]:
        errors.append(f"{found['include_lines']} code block(s) of unexpanded include lines")
    if found["clipped"]:
        errors.append(f"{found['clipped']} code block(s) cut off without a scrollbar")
    sizes = enumerate(found["text_px"], start=1)
    small = [f"{i}: {px:.1f} px" for i, px in sizes if round(px, 1) < min_text_px]
    if small:
        errors.append(f"diagram text too small (shrunk to fit the column): {', '.join(small)}")
    name = shot_name(page)
    browser_page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    # The fixed header would cover the top of a tall diagram's picture.
    browser_page.add_style_tag(content=".md-header, .md-tabs { visibility: hidden !important; }")
    for i, diagram in enumerate(browser_page.locator("div.mermaid").all(), start=1):
        try:
            diagram.screenshot(path=str(shots / f"{name}.mermaid-{i}.png"), timeout=5_000)
        except PlaywrightError as exc:
            errors.append(f"diagram {i}: no picture ({str(exc).splitlines()[0][:120]})")
    browser_page.close()
    smallest = f"{min(found['text_px']):.1f}px" if found["text_px"] else "-"
    summary = (
        f"diagrams {found['rendered']}/{n_expected}  smallest text {smallest:>6}  "
        f"scrolling-code {found['scrolling']}  errors {len(errors)}"
    )
    return summary, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="page names or prefixes: ch07, ch07-scheduler.md")
    parser.add_argument("--no-build", action="store_true", help="reuse site-check/site/")
    parser.add_argument("--chromium", help="the Chromium binary (default: chromium on PATH)")
    parser.add_argument("--width", type=int, default=1280, help="viewport width (default 1280)")
    parser.add_argument(
        "--min-text-px",
        type=float,
        default=11.0,
        help="fail a diagram whose text is shown smaller than this (default 11 px)",
    )
    args = parser.parse_args()

    if sync_playwright is None:
        sys.exit("needs Playwright: pip install -c constraints.txt -e '.[site]'")

    site = OUT / "site"
    if not args.no_build:
        build(site)
    elif not site.is_dir():
        sys.exit("no site-check/site/: run once without --no-build")
    pages = pages_of(site, args.pages)
    for page in pages:
        for old in OUT.glob(f"{shot_name(page)}.*png"):
            old.unlink()
    server, base = serve(site)
    external: list[str] = []
    tolerated: set[str] = set()

    def only_local(route) -> None:
        url = route.request.url
        if is_local(url):
            route.continue_()
        else:
            external.append(url)
            route.abort()

    failed = 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=find_chromium(args.chromium),
            args=["--no-sandbox", "--disable-gpu", "--lang=zh-CN"],
            ignore_default_args=["--hide-scrollbars"],  # the screenshots show code scrollbars
        )
        context = browser.new_context(
            viewport={"width": args.width, "height": 900}, locale="zh-CN", service_workers="block"
        )
        context.add_init_script(OPEN_SHADOW_ROOTS)
        context.route("**/*", only_local)
        width = max(len(p) for p in pages) + 2
        for page in pages:
            external.clear()
            summary, errors = check_page(
                context, base, page, expected_diagrams(site, page), OUT, args.min_text_px
            )
            for url in external:
                if TOLERATED.match(url):
                    tolerated.add(url)
                else:
                    errors.append(f"outside request (blocked): {url}")
            if errors:
                failed += 1
                summary = re.sub(r"errors \d+", f"errors {len(errors)}", summary)
            print(f"{page or '/':<{width}} {summary}", flush=True)
            for err in errors:
                print(f"    {err}", flush=True)
        browser.close()
    server.shutdown()
    for url in sorted(tolerated):
        print(f"tolerated, blocked: {url} (material's repository stars; the link works without)")
    print(f"{len(pages)} pages, {failed} failed; screenshots in {OUT.relative_to(ROOT)}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
