// Break opportunities inside long identifiers, between their words only: after "." "/" "," "="
// "_" ":" "[" and after a "-" that joins two words (never inside the leading "--" of a flag), so
// that a module path, a test id, a --long-flag-name or a snake_case name wraps between its parts
// and never inside a word. Each part becomes its own span.pre (which docs/_static/mfsdp.css keeps
// whole: white-space nowrap) with a <wbr> between them, in the literal's <code>, which wraps
// normally. Applies to literals in running text and tables, to the page table of contents'
// entries (an API page's member names), and to the left sidebar's entries (the API pages'
// dotted names); code blocks are left alone.
document.addEventListener("DOMContentLoaded", () => {
  const BREAK = /(?<=[./,=_:\[]|[^-]-(?=[^-]))/;
  // the page's table of contents also breaks a class name between its words (Context|Parallel)
  const TOC_BREAK = /(?<=[./,=_:\[]|[^-]-(?=[^-]))|(?<=[a-z])(?=[A-Z])/;
  for (const span of document.querySelectorAll("article span.pre, .bd-sidebar-secondary span.pre")) {
    if (span.closest("pre")) continue;
    const text = span.textContent;
    if (text.length < 12 || span.children.length) continue;
    const parts = text.split(span.closest(".bd-sidebar-secondary") ? TOC_BREAK : BREAK);
    if (parts.length < 2) continue;
    const fragment = document.createDocumentFragment();
    parts.forEach((part, i) => {
      if (i) fragment.appendChild(document.createElement("wbr"));
      const piece = document.createElement("span");
      piece.className = span.className;
      piece.textContent = part;
      fragment.appendChild(piece);
    });
    span.replaceWith(fragment);
  }
  // Plain text that is one long identifier: the sidebar's entries and the API pages' titles
  // (mfsdp.checkpoint.detect.is_megatron_fsdp), whose "#" link would otherwise land past the column.
  const texts = [...document.querySelectorAll(".bd-sidebar-primary a, article h1")]
    .flatMap(el => [...el.childNodes].filter(n => n.nodeType === Node.TEXT_NODE));
  for (const node of texts) {
    const text = node.data;
    if (text.length < 12 || /\s/.test(text.trim())) continue;
    const parts = text.split(BREAK);
    if (parts.length < 2) continue;
    const fragment = document.createDocumentFragment();
    parts.forEach((part, i) => {
      if (i) fragment.appendChild(document.createElement("wbr"));
      fragment.appendChild(document.createTextNode(part));
    });
    node.replaceWith(fragment);
  }
});
