"""Checks on every figure a recipe shows, before sphinx-gallery saves it.

sphinx-gallery saves the figures that are open at the end of a cell. A figure made in one cell and
drawn in the next is saved half drawn: an empty 0-1 axes on the page (and as the thumbnail). The
scraper here (``image_scrapers`` in ``conf.py``) looks at each open figure first and warns, which
``make docs`` (``-W``) turns into an error, when an axes has nothing drawn in it or a legend covers
a label, a title or a tick label.
"""

from __future__ import annotations

from sphinx.util import logging

logger = logging.getLogger(__name__)


def _drawn(ax) -> bool:
    """Whether ``ax`` holds anything a reader would see as data (lines, bars, collections, images,
    text placed in the axes)."""
    return bool(ax.lines or ax.patches or ax.collections or ax.images or ax.texts or ax.tables)


def figure_problems(fig) -> list[str]:
    """What is wrong with ``fig`` as a reader would see it: empty axes, legends over text."""
    problems = []
    visible = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    for i, ax in enumerate(visible):
        if not _drawn(ax):
            title = ax.get_title() or f"axes {i + 1}"
            problems.append(f"axes {title!r} is empty (drawn in a later cell?)")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for ax in visible for t in
             (ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label,
              *ax.get_xticklabels(), *ax.get_yticklabels(), *ax.texts)
             if t.get_visible() and t.get_text().strip()]
    if fig._suptitle is not None:
        texts.append(fig._suptitle)
    legends = [ax.get_legend() for ax in visible if ax.get_legend() is not None] + list(fig.legends)
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for text in texts:
            other = text.get_window_extent(renderer)
            if box.overlaps(other) and other.width > 0:
                problems.append(f"a legend covers the text {text.get_text()!r}")
        for other in legends:
            if other is not legend and box.overlaps(other.get_window_extent(renderer)):
                problems.append("two legends overlap")
    return problems


def checked_matplotlib_scraper(block, block_vars, gallery_conf, **kwargs):
    """sphinx-gallery's matplotlib scraper, after :func:`figure_problems` on every open figure."""
    import matplotlib.pyplot as plt
    from sphinx_gallery.scrapers import matplotlib_scraper

    for num in plt.get_fignums():
        for problem in figure_problems(plt.figure(num)):
            logger.warning("%s: figure %d: %s", block_vars.get("src_file", "recipe"), num, problem)
    return matplotlib_scraper(block, block_vars, gallery_conf, **kwargs)
