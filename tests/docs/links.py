#!/usr/bin/env python3
"""Every relative Markdown link in README.md and docs/ names a file or folder that exists.

  python3 tests/docs/links.py REPO_ROOT
"""
import glob
import os
import re
import sys


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    files = [os.path.join(root, "README.md")] + sorted(
        glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
    broken, checked = [], 0
    for f in files:
        with open(f, encoding="utf-8") as fh:
            text = fh.read()
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if link.startswith(("http://", "https://", "#", "mailto:")):
                continue
            path = link.split("#")[0]
            if not path:
                continue
            checked += 1
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(f), path))):
                line = text.count("\n", 0, m.start()) + 1
                broken.append("%s:%d: %s" % (os.path.relpath(f, root), line, link))
    for b in broken:
        print("broken link:", b)
    print("links: %d relative links in %d files checked, %d broken" % (checked, len(files),
                                                                      len(broken)))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
