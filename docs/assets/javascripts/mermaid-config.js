// The book's mermaid settings. Material calls mermaid.initialize with its own theme once it finds
// the global `mermaid` (assets/vendor/mermaid-*.min.js, loaded just before this file); ours are
// merged into that call. The font stack is the one extra.css gives --md-mermaid-font-family, so
// mermaid measures its labels with the font they are drawn in.
(function () {
  if (typeof mermaid === "undefined") return;
  var initialize = mermaid.initialize;
  mermaid.initialize = function (config) {
    var font = getComputedStyle(document.documentElement)
      .getPropertyValue("--md-mermaid-font-family").trim();
    return initialize.call(mermaid, Object.assign({}, config, {
      fontFamily: font || "sans-serif",
      // Flowcharts: labels wrap at 260 px instead of 200, fewer lines broken mid-phrase.
      flowchart: Object.assign({}, config.flowchart, { wrappingWidth: 260 }),
      // Sequence diagrams: narrower participant boxes and gaps (mermaid's are 150 and 50 px), so
      // that four or five participants fit the column without shrinking the text.
      sequence: Object.assign({}, config.sequence, { width: 100, actorMargin: 30 }),
    }));
  };
})();
