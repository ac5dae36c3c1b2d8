// Break opportunities inside long literals in tables, between the words of an identifier only:
// after "." "/" "," "=" "_" and after a "-" that joins two words (never inside the leading "--" of
// a flag), so that a module path, a --long-flag-name or a snake_case name wraps between its parts
// and never inside a word (docs/_static/mfsdp.css keeps each word of a literal whole).
document.addEventListener("DOMContentLoaded", () => {
  for (const span of document.querySelectorAll("article table span.pre")) {
    const text = span.textContent;
    if (text.length < 12) continue;
    const parts = text.split(/(?<=[./,=_]|[^-]-(?=[^-]))/);
    if (parts.length < 2) continue;
    span.textContent = "";
    for (const part of parts) {
      span.appendChild(document.createTextNode(part));
      span.appendChild(document.createElement("wbr"));
    }
  }
});
