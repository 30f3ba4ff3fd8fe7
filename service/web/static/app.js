// headatlas serve: the little the pages do in the browser. Everything they show is on the page
// without this script (tables, charts, links, forms); it adds tooltips, auto-submitting choices,
// tables sorted by a header clicked and narrowed by text and facets, the example window's heatmaps
// (fetched when the head's page opens) and the live progress of running runs. Text from the data is set with textContent, never as markup.
"use strict";

(function () {
  const tip = () => document.getElementById("tip");

  // --- tooltips: any element with data-tip, and a token matrix's cells -------------------------
  const TIPPED = "[data-tip], svg.token-matrix rect[data-v]";
  function tipText(target) {
    if (target.hasAttribute("data-tip")) return target.getAttribute("data-tip");
    // a cell of a token matrix (own_text): its row's and column's tokens, as their labels say them, and its value
    const row = target.parentNode, svg = target.closest("svg");
    const j = Array.prototype.indexOf.call(row.children, target);
    const label = (axis, k) => { const t = svg.querySelector(`text.${axis}[data-i="${k}"]`); return t ? t.getAttribute("data-tip") : k; };
    return `${label("row", row.getAttribute("data-i"))} · ${label("col", j)}: ${target.getAttribute("data-v")}`;
  }
  function showTip(target, x, y) {
    const box = tip();
    if (!box) return;
    box.textContent = tipText(target);
    box.hidden = false;
    const w = box.offsetWidth, h = box.offsetHeight;
    box.style.left = Math.min(x + 14, window.innerWidth - w - 8) + "px";
    box.style.top = (y + 18 + h > window.innerHeight ? y - h - 10 : y + 18) + "px";
  }
  function hideTip() { const box = tip(); if (box) box.hidden = true; }
  document.addEventListener("mousemove", (ev) => {
    const target = ev.target.closest ? ev.target.closest(TIPPED) : null;
    if (target) showTip(target, ev.clientX, ev.clientY); else hideTip();
  });
  document.addEventListener("focusin", (ev) => {
    const target = ev.target.closest ? ev.target.closest("[data-tip]") : null;
    if (!target) return;
    const r = target.getBoundingClientRect();
    showTip(target, r.left, r.bottom - 10);
  });
  document.addEventListener("focusout", hideTip);

  // --- forms: a choice submits its form --------------------------------------------------------
  document.addEventListener("change", (ev) => {
    if (ev.target.matches && ev.target.matches("select[data-autosubmit]")) ev.target.form.submit();
  });

  // --- tables: sorted by a header clicked, narrowed by the text typed and by facets ----------------
  // A cell's value is its data-sort (full precision; the page shows it rounded), a text cell's its
  // text; a cell with neither (no value) sorts last whichever way.
  function cellKey(row, i, text) {
    const cell = row.cells[i];
    if (!cell) return "";
    if (cell.hasAttribute("data-sort")) return cell.getAttribute("data-sort");
    return text ? cell.textContent : "";
  }
  function sortBy(th) {
    const table = th.closest("table");
    const body = table.tBodies[0];
    const i = Array.prototype.indexOf.call(th.parentNode.cells, th);
    const text = th.getAttribute("data-type") === "text";
    // first click: numbers largest first (as the server's sort links), text from A; again: the other way
    const was = th.getAttribute("aria-sort");
    const down = was === "none" || !was ? !text : was === "ascending";
    const rows = Array.from(body.rows).map((row) => ({ row, key: cellKey(row, i, text) }));
    const sign = down ? -1 : 1;
    rows.sort((a, b) => {
      if (a.key === "" || b.key === "") return (a.key === "") - (b.key === "");
      let d = text ? NaN : parseFloat(a.key) - parseFloat(b.key);
      if (isNaN(d)) d = a.key.localeCompare(b.key, undefined, { numeric: true });
      return sign * d;
    });
    body.append(...rows.map((r) => r.row));
    for (const cell of th.parentNode.cells) cell.setAttribute("aria-sort", "none");
    th.setAttribute("aria-sort", down ? "descending" : "ascending");
  }
  document.addEventListener("click", (ev) => {
    const th = ev.target.closest ? ev.target.closest("table[data-sortable] > thead th") : null;
    if (!th) return;
    ev.preventDefault(); // a header's link sorts on the server, for pages read without this script
    sortBy(th);
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter" && ev.key !== " ") return;
    const th = ev.target.matches && ev.target.matches("table[data-sortable] > thead th") ? ev.target : null;
    if (!th) return;
    ev.preventDefault();
    sortBy(th);
  });

  function refilter(table) {
    const id = "#" + table.id;
    const search = document.querySelector(`input[data-filter="${id}"]`);
    const words = search ? search.value.toLowerCase().split(/\s+/).filter(Boolean) : [];
    const heads = Array.from(table.tHead.rows[0].cells);
    const chosen = Array.from(document.querySelectorAll(`select[data-facet-for="${id}"]`))
      .filter((box) => box.value !== "")
      .map((box) => {
        const th = heads.find((h) => h.getAttribute("data-col") === box.getAttribute("data-col"));
        return [heads.indexOf(th), th && th.getAttribute("data-type") === "text", box.value];
      });
    for (const row of table.tBodies[0].rows) {
      const text = row.textContent.toLowerCase();
      row.hidden = !(words.every((w) => text.includes(w)) && chosen.every(([i, t, v]) => i >= 0 && cellKey(row, i, t) === v));
    }
  }
  document.addEventListener("input", (ev) => {
    const input = ev.target;
    if (!input.matches || !input.matches("input[data-filter]")) return;
    const table = document.querySelector(input.getAttribute("data-filter"));
    if (table) refilter(table);
  });
  document.addEventListener("change", (ev) => {
    const box = ev.target;
    if (!box.matches || !box.matches("select[data-facet-for]")) return;
    const table = document.querySelector(box.getAttribute("data-facet-for"));
    if (table) refilter(table);
  });

  // --- the example window ------------------------------------------------------------------------
  const DIVERGING = ["#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#fddbc7", "#f4a582", "#d6604d", "#b2182b"];
  const SEQUENTIAL = ["#ffffff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"];
  function mix(stops, t) {
    t = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(Math.floor(t), stops.length - 2), f = t - i;
    const a = stops[i], b = stops[i + 1];
    const c = [1, 3, 5].map((k) => Math.round(parseInt(a.substr(k, 2), 16) * (1 - f) + parseInt(b.substr(k, 2), 16) * f));
    return "rgb(" + c.join(",") + ")";
  }

  function heatmap(title, matrix, diverging, doc, high) {
    const n = matrix.length, size = Math.max(n, Math.min(480, 6 * n));
    const cell = size / n;
    const figure = document.createElement("figure");
    const caption = document.createElement("figcaption");
    caption.textContent = title;
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = Math.round(size);
    canvas.setAttribute("aria-label", title);
    const ctx = canvas.getContext("2d");
    let top = 0;
    for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) if (i !== j || !diverging) top = Math.max(top, Math.abs(matrix[i][j]));
    top = top || 1;
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < n; j++) {
        const v = matrix[i][j];
        // attention: colour by √(A / max), so that weights well under the largest still show
        ctx.fillStyle = diverging ? mix(DIVERGING, 0.5 + v / (2 * top)) : mix(SEQUENTIAL, Math.sqrt(v / top));
        ctx.fillRect(j * cell, i * cell, Math.ceil(cell), Math.ceil(cell));
      }
    }
    ctx.setLineDash([4, 3]);
    ctx.strokeStyle = "#555";
    for (const s of doc.sentence_starts) {
      ctx.beginPath(); ctx.moveTo(s * cell, 0); ctx.lineTo(s * cell, size); ctx.stroke();
      ctx.beginPath(); ctx.moveTo(0, s * cell); ctx.lineTo(size, s * cell); ctx.stroke();
    }
    ctx.setLineDash([]);
    if (high) {
      ctx.strokeStyle = "#000";
      ctx.lineWidth = Math.max(0.75, cell / 6);
      for (const [i, j] of high) {
        ctx.strokeRect(j * cell, i * cell, cell, cell);
        ctx.strokeRect(i * cell, j * cell, cell, cell);
      }
    }
    const readout = document.createElement("div");
    readout.className = "readout";
    readout.textContent = "hover a cell";
    canvas.addEventListener("mousemove", (ev) => {
      const r = canvas.getBoundingClientRect();
      const j = Math.floor((ev.clientX - r.left) / r.width * n), i = Math.floor((ev.clientY - r.top) / r.height * n);
      if (i < 0 || j < 0 || i >= n || j >= n) return;
      readout.textContent = `${i} «${doc.tokens[i]}» · ${j} «${doc.tokens[j]}»: ${matrix[i][j]}` +
        (high && high.some(([a, b]) => (a === i && b === j) || (a === j && b === i)) ? "  (in H)" : "");
      markTokens(doc, i, j);
    });
    figure.append(canvas, readout, caption);
    return figure;
  }

  function markTokens(doc, i, j) {
    const strip = document.getElementById("example-tokens");
    if (!strip) return;
    strip.querySelectorAll("span.i, span.j").forEach((s) => { s.className = ""; });
    if (strip.children[i]) strip.children[i].className = "i";
    if (strip.children[j]) strip.children[j].className = "j";
  }

  function drawExample(box, doc) {
    box.replaceChildren();
    const said = document.createElement("p");
    said.className = "muted";
    said.textContent = `${doc.model}, layer ${doc.layer}, head ${doc.head}: window ${doc.document_window} of the document at ` +
      `${doc.source}, line ${doc.line}; ${doc.tokens.length} tokens, ${doc.high_pairs.length} high-similarity pairs. ` +
      (doc.same_window ? "The window the run analysed (same window id). " : "") +
      `Computed in ${doc.computed_s.toFixed(2)} s` +
      (doc.model_load_s > 0 ? ` after loading the model (${doc.model_load_s.toFixed(1)} s, once)` : "") +
      (doc.served_s < doc.computed_s ? "; kept since." : ".");
    box.append(said);
    if (doc.note) {
      const note = document.createElement("p");
      note.className = "warning";
      note.textContent = "note: " + doc.note;
      box.append(note);
    }
    const pair = document.createElement("div");
    pair.className = "pair";
    pair.append(
      heatmap("context similarity C = z zᵀ (C_ii = 0), H outlined", doc.csm, true, doc, doc.high_pairs),
      heatmap("attention A (rows: queries; colour: √A)", doc.attention, false, doc, null),
    );
    box.append(pair);
    const strip = document.createElement("p");
    strip.className = "tokens";
    strip.id = "example-tokens";
    doc.tokens.forEach((t) => { const s = document.createElement("span"); s.textContent = t; strip.append(s, " "); });
    box.append(strip);
    box.setAttribute("data-state", "done");
  }

  function loadExample(box) {
    const started = performance.now();
    const waiting = box.querySelector(".computing");
    const timer = setInterval(() => {
      if (waiting) waiting.textContent = `computing the window … ${((performance.now() - started) / 1000).toFixed(1)} s`;
    }, 200);
    box.setAttribute("data-state", "computing");
    fetch(box.getAttribute("data-src"))
      .then((r) => r.json().then((doc) => ({ ok: r.ok, doc })))
      .then(({ ok, doc }) => {
        clearInterval(timer);
        if (!ok) throw new Error(doc.error || "the window could not be computed");
        drawExample(box, doc);
      })
      .catch((err) => {
        clearInterval(timer);
        box.replaceChildren();
        const p = document.createElement("p");
        p.className = "error";
        p.textContent = "error: " + err.message;
        box.append(p);
        box.setAttribute("data-state", "error");
      });
  }

  // --- live progress of running runs ---------------------------------------------------------------
  function pollProgress(table) {
    const url = table.getAttribute("data-progress");
    const tick = () => fetch(url).then((r) => r.json()).then((rows) => {
      const open = new Set(rows.map((r) => String(r.run_id)));
      for (const r of rows) {
        const status = table.querySelector(`td.status[data-run="${r.run_id}"]`);
        const windows = table.querySelector(`td.windows[data-run="${r.run_id}"]`);
        if (windows) windows.textContent = r.windows.toLocaleString("en");
        if (status) {
          status.textContent = r.status + " ";
          if (r.share !== null) {
            const bar = document.createElement("progress");
            bar.max = 1; bar.value = r.share;
            status.append(bar, ` ${Math.round(100 * r.share)}%`);
          }
        }
      }
      const finished = [...table.querySelectorAll("td.status[data-run]")].some(
        (td) => /^(created|running)/.test(td.textContent) && !open.has(td.getAttribute("data-run")));
      if (finished) window.location.reload();
      else if (rows.length) setTimeout(tick, 2000);
    }).catch(() => setTimeout(tick, 5000));
    setTimeout(tick, 2000);
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll("#example[data-src]").forEach(loadExample);
    document.querySelectorAll("table[data-progress]").forEach(pollProgress);
  });
})();
