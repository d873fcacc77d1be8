// Turnstile viewer: renders /api/overview and /api/rollouts/{id}. All text from the shards
// goes into the page through textContent, never as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function fmt(x, digits = 3) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits).replace(/\.?0+$/, "");
}

async function getJSON(url) {
  const resp = await fetch(url);
  if (!resp.ok) throw new Error(`${url}: ${resp.status} ${await resp.text()}`);
  return resp.json();
}

function showError(err) {
  const box = document.getElementById("error");
  box.hidden = false;
  box.textContent = String(err);
}

// -- overview ------------------------------------------------------------------------
let overviewData = null;

function drawPlot(versions) {
  const box = document.getElementById("plot");
  box.replaceChildren();
  const points = versions.filter((v) => v.mean_reward !== null || v.mean_tokens !== null);
  if (!points.length) {
    box.append(el("p", { class: "note", text: "No rollouts with a policy version yet." }));
    return;
  }
  const W = 900, H = 240, L = 50, R = 60, T = 14, B = 34;
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, id: "version-plot" });
  const xs = points.map((p) => p.version);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const x = (v) => (x1 === x0 ? (L + W - R) / 2 : L + ((v - x0) / (x1 - x0)) * (W - L - R));
  const series = (key) => points.filter((p) => p[key] !== null).map((p) => [p.version, p[key]]);
  const rewards = series("mean_reward"), tokens = series("mean_tokens");
  const range = (vals) => {
    if (!vals.length) return [0, 1];
    let lo = Math.min(...vals), hi = Math.max(...vals);
    if (lo === hi) { lo -= 1; hi += 1; }
    return [lo, hi];
  };
  const [r0, r1] = range(rewards.map((p) => p[1]));
  const [t0, t1] = range(tokens.map((p) => p[1]).concat([0]));
  const yr = (v) => H - B - ((v - r0) / (r1 - r0)) * (H - T - B);
  const yt = (v) => H - B - ((v - t0) / (t1 - t0)) * (H - T - B);
  plot.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  plot.append(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  plot.append(svg("line", { class: "axis", x1: W - R, y1: T, x2: W - R, y2: H - B }));
  const label = (tx, ty, text, anchor = "middle") => {
    const t = svg("text", { x: tx, y: ty, "text-anchor": anchor });
    t.textContent = text;
    plot.append(t);
  };
  for (const p of points) label(x(p.version), H - B + 14, String(p.version));
  label((L + W - R) / 2, H - 4, "policy version");
  label(L - 6, yr(r1) + 4, fmt(r1, 2), "end");
  label(L - 6, yr(r0) + 4, fmt(r0, 2), "end");
  label(W - R + 6, yt(t1) + 4, fmt(t1, 0), "start");
  label(W - R + 6, yt(t0) + 4, fmt(t0, 0), "start");
  const line = (pts, cls, y) => {
    if (!pts.length) return;
    const d = pts.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
    plot.append(svg("path", { class: cls, d: d.join(" ") }));
    for (const p of pts) {
      const c = svg("circle", { cx: x(p[0]), cy: y(p[1]), r: 3.5, class: cls });
      const tip = svg("title", {});
      tip.textContent = `version ${p[0]}: ${fmt(p[1])}`;
      c.append(tip);
      plot.append(c);
    }
  };
  line(rewards, "reward", yr);
  line(tokens, "tokens-line", yt);
  box.append(plot);
  box.append(el("p", { class: "note" },
    el("span", { style: "color:#2563eb", text: "── mean reward (left axis)   " }),
    el("span", { style: "color:#ea580c", text: "- - mean tokens per sample (right axis)" })));
}

function rolloutRow(r) {
  const versions = (r.policy_versions || []).join(", ");
  const tr = el("tr", { "data-rollout": r.rollout_id },
    el("td", {}, el("a", { href: `#/rollout/${encodeURIComponent(r.rollout_id)}`,
                           text: r.rollout_id })),
    el("td", { class: `status-${r.status}`, text: r.status }),
    el("td", { text: r.group_id ?? "" }), el("td", { text: r.task_id ?? "" }),
    el("td", { text: fmt(r.reward) }), el("td", { text: String(r.num_turns) }),
    el("td", { text: String(r.num_samples) }), el("td", { text: String(r.num_breaks) }),
    el("td", { text: versions }));
  tr.addEventListener("click", () => { location.hash = `#/rollout/${r.rollout_id}`; });
  return tr;
}

function renderRollouts() {
  const query = document.getElementById("filter").value.toLowerCase();
  const rows = overviewData.rollouts.filter((r) => !query ||
    [r.rollout_id, r.group_id, r.task_id, r.status].some((v) => (v || "").toLowerCase()
      .includes(query)));
  document.querySelector("#rollouts tbody").replaceChildren(...rows.map(rolloutRow));
  document.getElementById("rollout-count").textContent =
    `(${rows.length} of ${overviewData.rollouts.length})`;
}

async function showOverview() {
  overviewData = await getJSON("/api/overview");
  document.getElementById("directory").textContent = overviewData.directory;
  document.getElementById("tokenizer").textContent = overviewData.tokenizer
    ? `tokenizer: ${overviewData.tokenizer}` : "no tokenizer: token ids shown";
  drawPlot(overviewData.versions);
  renderRollouts();
}

// -- one rollout ---------------------------------------------------------------------
function tokenColour(mask, logprob) {
  if (!mask) return null;
  if (logprob === null) return "hsl(190, 60%, 85%)";
  const p = Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 70%, 80%)`;
}

function renderTokens(sample) {
  const box = el("div", { class: "tokens" });
  const starts = new Map(), completions = new Map();
  for (const s of sample.turn_spans) {
    starts.set(s.prompt_start, s);
    completions.set(s.completion_start, s);
  }
  const images = new Map();
  for (const im of sample.image_spans || []) {
    if (im.start !== null && im.length) images.set(im.start, im);
  }
  const brk = sample.break ? sample.break.position : -1;
  let role = "";
  let skipUntil = -1;
  sample.tokens.forEach(([id, text, mask, logprob, tokRole, special], i) => {
    if (i < skipUntil) return;
    if (images.has(i)) {
      box.append(renderImage(images.get(i)));
      skipUntil = i + images.get(i).length;
      return;
    }
    if (starts.has(i)) {
      box.append(el("span", { class: "turn-mark", text: `turn ${starts.get(i).turn_index}` }));
    }
    if (completions.has(i)) {
      box.append(el("span", { class: "turn-mark",
                              text: `completion ${completions.get(i).turn_index}` }));
    }
    if (tokRole !== role && tokRole) {
      box.append(el("span", { class: `role-mark role-${tokRole}`, text: tokRole }));
    }
    role = tokRole;
    const cls = ["t", mask ? "m1" : "m0"];
    if (special) cls.push("special");
    if (i === brk) cls.push("brk");
    const span = el("span", { class: cls.join(" "), text });
    const colour = tokenColour(mask, logprob);
    if (colour && !special) span.style.background = colour;
    const p = logprob === null ? "" : ` logprob ${fmt(logprob)} p ${fmt(Math.exp(logprob))}`;
    span.title = `#${i} id ${id} mask ${mask}${p}${tokRole ? " " + tokRole : ""}`;
    box.append(span);
  });
  if (sample.truncated) {
    box.append(el("p", { class: "note",
                         text: `… cut at ${sample.tokens.length} of ${sample.num_tokens}` }));
  }
  return box;
}

function renderImage(im) {
  // An image at its placeholder span: the thumbnail (stored images) or the URL it was
  // recorded by (remote images are not fetched by the viewer), and how many tokens it took.
  const label = `${im.length} image tokens at ${im.start}`;
  const fig = el("span", { class: "image-span", title: label });
  if (im.sha256) {
    const img = el("img", { class: "thumb", src: `/media/${im.sha256}`, loading: "lazy",
                            alt: `image ${im.sha256.slice(0, 12)}` });
    fig.append(img);
  } else {
    fig.append(el("span", { class: "note", text: `remote image ${im.url || ""}` }));
  }
  fig.append(el("span", { class: "image-label", text: label }));
  return fig;
}

function renderBreak(b) {
  const table = el("table", { class: "side-by-side" },
    el("thead", {}, el("tr", {}, el("th", { text: "position" }),
      el("th", { text: `sample ${b.parent} (context it broke from)` }),
      el("th", { text: "this sample (prompt)" }))));
  const body = el("tbody");
  const n = Math.max(b.parent_tokens.length, b.tokens.length);
  for (let k = 0; k < n; k++) {
    const pos = b.start + k;
    const left = b.parent_tokens[k], right = b.tokens[k];
    const differs = pos >= b.position;
    const cell = (tok) => el("td", { class: differs ? "diff" : "",
      text: tok ? `${JSON.stringify(tok[1])} (${tok[0]})` : "—" });
    body.append(el("tr", {}, el("td", { text: String(pos) }), cell(left), cell(right)));
  }
  table.append(body);
  return el("div", { class: "break" },
    el("strong", { text: `Stitching break: ${b.kind} at token ${b.position}` }),
    el("p", { class: "note", text: b.detail || "" }), table);
}

function kv(pairs) {
  const dl = el("dl", { class: "kv" });
  for (const [k, v] of pairs) {
    if (v === null || v === undefined || v === "") continue;
    dl.append(el("dt", { text: k }),
      el("dd", { text: typeof v === "string" ? v : JSON.stringify(v, null, 1) }));
  }
  return dl;
}

async function showRollout(id) {
  const r = await getJSON(`/api/rollouts/${encodeURIComponent(id)}`);
  const rewards = Object.entries(r.rewards || {}).map(([k, v]) => `${k} = ${fmt(v)}`);
  const info = Object.entries(r.rewards_info || {}).map(([k, v]) => `${k}: ${v}`);
  document.getElementById("rollout-head").replaceChildren(
    el("h2", { text: `Rollout ${r.rollout_id}` }),
    kv([["status", r.status], ["group", r.group_id], ["task", r.task_id],
        ["reward", r.reward === null || r.reward === undefined ? null : fmt(r.reward)],
        ["rewards", rewards.join(", ")], ["verifier info", info.join("\n")],
        ["policy versions", (r.policy_versions || []).join(", ")],
        ["samples", r.samples.length], ["metadata", r.metadata]]));
  document.querySelector("#turns tbody").replaceChildren(...r.turns.map((t) => el("tr", {},
    ...[t.turn_index, t.choice_index].map((v) => el("td", { text: String(v) })),
    el("td", { class: `status-${t.status}`, text: t.status }),
    ...[t.policy_version, t.num_prompt_tokens, t.num_completion_tokens, t.finish_reason,
        fmt(t.ttft_s), fmt(t.total_s), t.error].map((v) => el("td", { text: v ?? "" })))));
  const samples = document.getElementById("samples");
  samples.replaceChildren(...r.samples.map((s) => {
    const head = el("h3", { text: `Sample ${s.sample_index} · ${s.num_tokens} tokens · ` +
      `${s.num_loss_tokens} with loss · ${s.num_turns} turns · ` });
    head.append(el("span", { class: s.parent_sample_index === null ? "" : "kind",
                             text: `starts: ${s.break_kind}` }));
    const panel = el("div", { class: "panel sample", "data-sample": String(s.sample_index) },
      head);
    if (s.break) panel.append(renderBreak(s.break));
    panel.append(renderTokens(s));
    return panel;
  }));
  if (!r.decoded) {
    samples.prepend(el("p", { class: "note",
      text: "No tokenizer: token ids are shown. Start the viewer with --tokenizer DIR." }));
  }
}

// -- routing -------------------------------------------------------------------------
async function route() {
  document.getElementById("error").hidden = true;
  const match = location.hash.match(/^#\/rollout\/(.+)$/);
  document.getElementById("overview-view").hidden = Boolean(match);
  document.getElementById("rollout-view").hidden = !match;
  try {
    if (match) await showRollout(decodeURIComponent(match[1]));
    else await showOverview();
    document.body.dataset.ready = location.hash || "#/";
  } catch (err) {
    showError(err);
  }
}

document.getElementById("filter").addEventListener("input", renderRollouts);
window.addEventListener("hashchange", route);
route();
