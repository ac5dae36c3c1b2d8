// Break opportunities inside long literals in tables, after "." "/" and "," only, so that a
// module path or a --from/--to pair can wrap between its parts and an identifier never breaks
// inside a word (docs/_static/mfsdp.css keeps each word of a literal whole).
document.addEventListener("DOMContentLoaded", () => {
  for (const span of document.querySelectorAll("article table span.pre")) {
    const text = span.textContent;
    if (text.length < 20 || !/[./,]/.test(text)) continue;
    span.textContent = "";
    for (const part of text.split(/(?<=[./,])/)) {
      span.appendChild(document.createTextNode(part));
      span.appendChild(document.createElement("wbr"));
    }
  }
});
