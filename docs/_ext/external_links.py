"""Links to the projects, issues and pull requests the guide mentions, added at build time.

* An issue or pull-request reference in running text, ``NVIDIA/Megatron-LM#5974`` or with a known
  project's short name (``Megatron-Bridge#4246``), becomes a link to it on GitHub (GitHub sends
  an ``/issues/N`` address of a pull request on to the pull request).
* The first mention of each project of :data:`PROJECTS` on a page becomes a link to the project,
  unless the page already links to it.

Text inside literals, code blocks, titles and existing links is left alone.
``tests/test_browser.py`` fails on a rendered page with an issue reference outside a link or a
project named with no link to it.
"""

from __future__ import annotations

import re

from docutils import nodes

PROJECTS: dict[str, str] = {
    "Megatron-LM": "https://github.com/NVIDIA/Megatron-LM",
    "Megatron-Bridge": "https://github.com/NVIDIA-NeMo/Megatron-Bridge",
    "Megatron-FSDP": "https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core/distributed/fsdp",
    "Megatron Core": "https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core",
    "megatron-core": "https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core",
    "torchtitan": "https://github.com/pytorch/torchtitan",
    "Transformer Engine": "https://github.com/NVIDIA/TransformerEngine",
    "TransformerEngine": "https://github.com/NVIDIA/TransformerEngine",
    "NCCL": "https://github.com/NVIDIA/nccl",
    "DeepSpeed": "https://github.com/deepspeedai/DeepSpeed",
    "safetensors": "https://github.com/huggingface/safetensors",
    "Slurm": "https://slurm.schedmd.com/",
    "FSDP2": "https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html",
    "torchrun": "https://docs.pytorch.org/docs/stable/elastic/run.html",
    "Hugging Face": "https://huggingface.co/",
    "TinyLlama": "https://github.com/jzhang38/TinyLlama",
    "DeepEP": "https://github.com/deepseek-ai/DeepEP",
    "tqdm": "https://github.com/tqdm/tqdm",
    "py-spy": "https://github.com/benfred/py-spy",
    "Nsight Systems": "https://developer.nvidia.com/nsight-systems",
    "pyxis": "https://github.com/NVIDIA/pyxis",
    "enroot": "https://github.com/NVIDIA/enroot",
    "cuDNN": "https://developer.nvidia.com/cudnn",
}
"""Projects the guide names, and where a reader finds them."""

REPOS = {"Megatron-LM": "NVIDIA/Megatron-LM", "Megatron-Bridge": "NVIDIA-NeMo/Megatron-Bridge",
         "TransformerEngine": "NVIDIA/TransformerEngine", "torchtitan": "pytorch/torchtitan",
         "pytorch": "pytorch/pytorch"}
"""Short names an issue reference may use for a repository."""

ISSUE = re.compile(r"(?<![\w/.-])(?:(?P<owner>[\w.-]+)/)?(?P<repo>[\w.-]+)#(?P<number>\d+)\b")
_SKIP = (nodes.literal, nodes.literal_block, nodes.reference, nodes.title, nodes.raw,
         nodes.target, nodes.doctest_block, nodes.system_message)
_NAMES = re.compile(r"(?<![\w/.-])(" + "|".join(
    re.escape(n) for n in sorted(PROJECTS, key=len, reverse=True)) + r")(?![\w-])")


def issue_url(match: re.Match) -> str | None:
    """The GitHub address of an issue reference, or None for an unknown short repository name."""
    repo = match["repo"]
    full = f"{match['owner']}/{repo}" if match["owner"] else REPOS.get(repo)
    return f"https://github.com/{full}/issues/{match['number']}" if full else None


def _link(text: str, url: str) -> nodes.reference:
    return nodes.reference(text, text, refuri=url, classes=["mfsdp-external"])


def _skipped(node: nodes.Node) -> bool:
    parent = node.parent
    while parent is not None:
        # a comment, but not autosummary's table (a subclass of comment that is rendered)
        if isinstance(parent, _SKIP) or type(parent) is nodes.comment:
            return True
        parent = parent.parent
    return False


def _replace(text_node: nodes.Text, pieces: list) -> None:
    parent = text_node.parent
    at = parent.index(text_node)
    parent.remove(text_node)
    for offset, piece in enumerate(p for p in pieces if not (isinstance(p, str) and not p)):
        parent.insert(at + offset, nodes.Text(piece) if isinstance(piece, str) else piece)


def add_links(app, doctree, docname) -> None:
    """Link the issue references and first project mentions of one page."""
    linked = {n.get("refuri", "").rstrip("/") for n in doctree.findall(nodes.reference)}
    for text_node in list(doctree.findall(nodes.Text)):
        if _skipped(text_node):
            continue
        text = str(text_node)
        pieces: list = []
        last = 0
        spans = [(m.start(), m.end(), issue_url(m)) for m in ISSUE.finditer(text)]
        for m in _NAMES.finditer(text):
            url = PROJECTS[m[1]]
            if url.rstrip("/") in linked or any(s < m.end() and m.start() < e for s, e, _ in spans):
                continue
            linked.add(url.rstrip("/"))
            spans.append((m.start(), m.end(), url))
        for start, end, url in sorted(s for s in spans if s[2]):
            pieces += [text[last:start], _link(text[start:end], url)]
            last = end
        if last:
            _replace(text_node, pieces + [text[last:]])


def setup(app):
    app.connect("doctree-resolved", add_links)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
