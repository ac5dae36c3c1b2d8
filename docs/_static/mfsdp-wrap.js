// Break opportunities inside long identifiers, between their words only: after "." "/" "," "="
// "_" ":" "[" and after a "-" that joins two words (never inside the leading "--" of a flag), so
// that a module path, a test id, a --long-flag-name or a snake_case name wraps between its parts
// and never inside a word (docs/_static/mfsdp.css keeps each word whole). Applies to literals in
// running text and tables, and to the left sidebar's entries (the API pages' dotted names); code
// blocks are left alone: they scroll.
document.addEventListener("DOMContentLoaded", () => {
  const split = (el) => {
    const text = el.textContent;
    if (text.length < 12 || el.children.length) return;
    const parts = text.split(/(?<=[./,=_:\[]|[^-]-(?=[^-]))/);
    if (parts.length < 2) return;
    el.textContent = "";
    for (const part of parts) {
      el.appendChild(document.createTextNode(part));
      el.appendChild(document.createElement("wbr"));
    }
  };
  for (const span of document.querySelectorAll("article span.pre")) {
    if (!span.closest("pre")) split(span);
  }
  for (const a of document.querySelectorAll(".bd-sidebar-primary a, .bd-sidebar-primary code span")) {
    split(a);
  }
});
