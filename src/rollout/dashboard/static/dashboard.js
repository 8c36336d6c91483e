// rollout dashboard: one script for its three pages (the runs, one run, a comparison).
// No dependencies and no build step: it fetches the JSON API (rollout/dashboard/app.py),
// polls it while runs are live, and draws its SVG line charts itself.
// Everything from the store goes into the page as text (textContent), never as HTML.
"use strict";

(() => {
  const KEY_STORAGE = "rollout-dashboard-key";
  const POLL_MS = 2000; // a run page and a comparison, while a run is not finished
  const INDEX_POLL_MS = 5000;
  const MAX_EVENTS = 200; // the run page keeps the newest this many
  const FIRST_METRICS = ["train/loss", "rollout/reward_mean"]; // charts shown first, in this order
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];
  const SVG_NS = "http://www.w3.org/2000/svg";
  const NUMBER = new Intl.NumberFormat("en-US", { maximumSignificantDigits: 4 });

  // ------------------------------------------------------------------ API and key

  class Unauthorized extends Error {}

  // `/#key=KEY` once: kept in this tab's sessionStorage, and taken out of the address bar.
  function takeKeyFromFragment() {
    const match = location.hash.match(/^#key=(.+)$/);
    if (match) {
      sessionStorage.setItem(KEY_STORAGE, decodeURIComponent(match[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  async function api(path) {
    const headers = {};
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, { headers, cache: "no-store" });
    if (response.status === 401) throw new Unauthorized("API key needed");
    if (!response.ok) {
      let detail = response.statusText;
      try {
        const body = await response.json();
        detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
      } catch (_) { /* not JSON: keep the status text */ }
      const error = new Error(detail);
      error.status = response.status;
      throw error;
    }
    return response.json();
  }

  function showKeyForm() {
    const input = el("input", { type: "password", id: "key", autocomplete: "off", placeholder: "API key" });
    const form = el("form", { class: "keyform" },
      el("p", {}, "This dashboard needs its API key (rollout dashboard --api-key)."), input,
      el("button", { type: "submit" }, "Open"));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY_STORAGE, input.value);
      location.reload();
    });
    main().replaceChildren(form);
    setLive("locked", true);
  }

  // Calls `tick` now and every `ms` until it returns false; a failed tick is retried.
  function poll(tick, ms) {
    const run = async () => {
      let again = true;
      try {
        again = (await tick()) !== false;
        setLive(again ? `live · updated ${clock(Date.now() / 1000)}` : "finished · not polling");
      } catch (error) {
        if (error instanceof Unauthorized) return showKeyForm();
        if (error.status === 404 || error.status === 400) {
          main().replaceChildren(el("p", { class: "error" }, error.message));
          return setLive("", false);
        }
        setLive(`error: ${error.message} · retrying`, true);
      }
      if (again) setTimeout(run, ms);
    };
    run();
  }

  // ------------------------------------------------------------------ DOM helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
    }
    node.append(...children.filter((c) => c !== null && c !== undefined).map((c) => (c instanceof Node ? c : String(c))));
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    return node;
  }

  const main = () => document.getElementById("main");

  function setLive(text, bad) {
    const live = document.getElementById("live");
    live.textContent = text;
    live.classList.toggle("bad", Boolean(bad));
  }

  function table(className, columns) {
    const body = el("tbody");
    const head = el("thead", {}, el("tr", {}, ...columns.map((c) => el("th", {}, c))));
    return { node: el("table", { class: className }, head, body), body };
  }

  function statusBadge(status, title) {
    return el("span", { class: `badge status-${status}`, title: title || null }, status === "crashed" ? "✖ crashed" : status);
  }

  function runLink(id, text) {
    return el("a", { href: `/runs/${encodeURIComponent(id)}` }, text || id.slice(0, 10));
  }

  function copyable(command) {
    const code = el("code", {}, command);
    const button = el("button", { type: "button", class: "copy", title: "copy" }, "copy");
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(command);
        button.textContent = "copied";
      } catch (_) { // no clipboard (plain http on another host): select the text instead
        const range = document.createRange();
        range.selectNodeContents(code);
        getSelection().removeAllRanges();
        getSelection().addRange(range);
      }
    });
    return el("span", { class: "command" }, code, button);
  }

  // ------------------------------------------------------------------ formatting

  function num(value) {
    if (value === null || value === undefined) return "–";
    if (typeof value !== "number") return String(value);
    const size = Math.abs(value);
    return size !== 0 && (size < 1e-3 || size >= 1e7) ? value.toExponential(2) : NUMBER.format(value);
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "";
    const s = Math.max(0, Math.floor(seconds));
    for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
      if (s >= size * (unit === "d" ? 2 : 1)) return `${Math.floor(s / size)}${unit} ago`;
    }
    return `${s}s ago`;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "";
    const s = Math.max(0, Math.floor(seconds));
    const pad = (n) => String(n).padStart(2, "0");
    return `${Math.floor(s / 3600)}:${pad(Math.floor((s % 3600) / 60))}:${pad(s % 60)}`;
  }

  function clock(epoch) {
    return new Date(epoch * 1000).toTimeString().slice(0, 8);
  }

  function timestamp(epoch) {
    if (epoch === null || epoch === undefined) return "";
    const d = new Date(epoch * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${clock(epoch)}`;
  }

  function bytes(size) {
    let value = size;
    for (const unit of ["B", "KiB", "MiB", "GiB"]) {
      if (value < 1024) return unit === "B" ? `${value} B` : `${value.toFixed(1)} ${unit}`;
      value /= 1024;
    }
    return `${value.toFixed(1)} TiB`;
  }

  function latestText(latest) {
    const short = { "train/loss": "loss", "rollout/reward_mean": "reward", "train/accuracy": "acc", "eval/pass@1": "pass@1" };
    return Object.entries(latest).map(([name, value]) => `${short[name] || name} ${num(value)}`).join(" · ");
  }

  function metricOrder(names) {
    const rank = (name) => (FIRST_METRICS.includes(name) ? FIRST_METRICS.indexOf(name) : FIRST_METRICS.length);
    return [...names].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
  }

  // ------------------------------------------------------------------ charts

  // One line per series ({label, color, points: [[step, value|null], ...]} sorted by step) on shared
  // axes; a null value breaks the line. Each line is a <path class="series" data-points="N">.
  function drawChart(root, series) {
    const W = Number(root.dataset.width) || 440, H = Number(root.dataset.height) || 210;
    const m = { l: 60, r: 12, t: 10, b: 24 };
    root.setAttribute("viewBox", `0 0 ${W} ${H}`);
    root.replaceChildren();
    const steps = series.flatMap((s) => s.points.map((p) => p[0]));
    const values = series.flatMap((s) => s.points.map((p) => p[1]).filter((v) => v !== null));
    if (!values.length) {
      root.append(text(W / 2, H / 2, "no data yet", "empty"));
      return null;
    }
    let [x0, x1] = [Math.min(...steps), Math.max(...steps)];
    if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
    let [y0, y1] = [Math.min(...values), Math.max(...values)];
    const pad = y0 === y1 ? Math.abs(y0) * 0.05 || 1 : (y1 - y0) * 0.06;
    [y0, y1] = [y0 - pad, y1 + pad];
    const X = (step) => m.l + ((step - x0) / (x1 - x0)) * (W - m.l - m.r);
    const Y = (value) => H - m.b - ((value - y0) / (y1 - y0)) * (H - m.t - m.b);
    for (let i = 0; i <= 4; i++) {
      const value = y0 + ((y1 - y0) * i) / 4;
      root.append(svg("line", { class: "grid", x1: m.l, x2: W - m.r, y1: Y(value), y2: Y(value) }));
      root.append(text(m.l - 5, Y(value) + 3.5, num(value), "ylabel"));
    }
    for (const step of new Set([x0, Math.round((x0 + x1) / 2), x1])) {
      root.append(text(X(step), H - 7, String(Math.round(step)), "xlabel"));
    }
    for (const s of series) {
      let d = "", pen = false, count = 0;
      for (const [step, value] of s.points) {
        if (value === null) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${X(step).toFixed(1)},${Y(value).toFixed(1)}`;
        pen = true;
        count += 1;
      }
      const path = svg("path", { class: "series", d, stroke: s.color, "data-points": count, "data-label": s.label });
      root.append(path);
      if (count === 1) { // a lone point draws no line
        const [step, value] = s.points.find((p) => p[1] !== null);
        root.append(svg("circle", { class: "dot", cx: X(step), cy: Y(value), r: 2.5, fill: s.color }));
      }
    }
    const cursor = svg("line", { class: "cursor", y1: m.t, y2: H - m.b, x1: -10, x2: -10 });
    root.append(cursor);
    return { X, x0, x1, m, W, cursor };
  }

  function text(x, y, content, className) {
    const node = svg("text", { x, y, class: className });
    node.textContent = content;
    return node;
  }

  // Hovering a chart moves a cursor to the nearest step and calls onHover(step) (null on leave).
  function followCursor(root, getScale, onHover) {
    root.addEventListener("mousemove", (event) => {
      const scale = getScale();
      if (!scale) return;
      const box = root.getBoundingClientRect();
      const x = ((event.clientX - box.left) / box.width) * scale.W;
      const fraction = (x - scale.m.l) / (scale.W - scale.m.l - scale.m.r);
      const step = Math.round(scale.x0 + Math.min(1, Math.max(0, fraction)) * (scale.x1 - scale.x0));
      const shown = onHover(step);
      const at = shown === null ? -10 : scale.X(shown);
      scale.cursor.setAttribute("x1", at);
      scale.cursor.setAttribute("x2", at);
    });
    root.addEventListener("mouseleave", () => {
      const scale = getScale();
      if (scale) scale.cursor.setAttribute("x1", -10), scale.cursor.setAttribute("x2", -10);
      onHover(null);
    });
  }

  // The point of `points` nearest to `step` (points sorted by step), or null.
  function nearest(points, step) {
    let best = null;
    for (const point of points) {
      if (point[1] === null) continue;
      if (best === null || Math.abs(point[0] - step) < Math.abs(best[0] - step)) best = point;
    }
    return best;
  }

  // ------------------------------------------------------------------ page: runs

  function indexView() {
    document.title = "runs · rollout dashboard";
    const selected = new Set();
    const compare = el("button", { type: "button", id: "compare", disabled: "" }, "Compare selected");
    compare.addEventListener("click", () => {
      location.href = `/compare?runs=${[...selected].map(encodeURIComponent).join(",")}`;
    });
    const runs = table("runs", ["", "id", "name", "algorithm", "status", "step", "age", "duration", "latest metrics"]);
    const evals = table("evals", ["id", "name", "model", "env", "status", "samples", "pass@1", "mean reward", "run", "age"]);
    const runsEmpty = el("p", { class: "muted", hidden: "" }, "No runs in this store yet.");
    const evalsEmpty = el("p", { class: "muted", hidden: "" }, "No evals yet.");
    main().replaceChildren(
      el("div", { class: "bar" }, el("h1", {}, "Runs"), compare), runs.node, runsEmpty,
      el("h2", {}, "Evals"), evals.node, evalsEmpty);
    const updateCompare = () => {
      compare.disabled = selected.size < 2;
      compare.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
    };

    poll(async () => {
      const [runData, evalData] = await Promise.all([api("/api/runs"), api("/api/evals")]);
      runs.body.replaceChildren(...runData.runs.map((run) => {
        const box = el("input", { type: "checkbox", "aria-label": `select ${run.id}`, checked: selected.has(run.id) ? "" : null });
        box.addEventListener("change", () => {
          box.checked ? selected.add(run.id) : selected.delete(run.id);
          updateCompare();
        });
        return el("tr", { class: `run-row${run.crashed ? " crashed" : ""}`, "data-run-id": run.id },
          el("td", {}, box), el("td", { class: "mono" }, runLink(run.id)), el("td", {}, run.name || ""),
          el("td", {}, run.algorithm), el("td", {}, statusBadge(run.status, run.error)),
          el("td", { class: "num" }, run.last_step ?? ""), el("td", {}, age(run.age_s)),
          el("td", { class: "num" }, duration(run.duration_s)), el("td", { class: "metrics" }, latestText(run.latest)));
      }));
      runsEmpty.hidden = runData.runs.length > 0;
      evals.body.replaceChildren(...evalData.evals.map(evalRow(true)));
      evalsEmpty.hidden = evalData.evals.length > 0;
      return true;
    }, INDEX_POLL_MS);
  }

  function evalRow(withRun) {
    return (e) => el("tr", { class: "eval-row", "data-eval-id": e.id },
      el("td", { class: "mono", title: e.id }, e.id.slice(0, 10)), el("td", {}, e.name || ""),
      el("td", { class: "wrap" }, e.model), el("td", {}, e.env), el("td", {}, statusBadge(e.status, e.error)),
      el("td", { class: "num" }, `${e.samples_stored}/${e.n_prompts * e.n}`),
      el("td", { class: "num" }, num(e.metrics["pass@1"])), el("td", { class: "num" }, num(e.metrics.mean_reward)),
      withRun ? el("td", {}, e.run_id ? runLink(e.run_id) : "", e.step !== null ? ` @ ${e.step}` : "") : el("td", { class: "num" }, e.step ?? ""),
      el("td", {}, age(e.age_s)));
  }

  // ------------------------------------------------------------------ page: one run

  function runView(runId) {
    const base = `/api/runs/${encodeURIComponent(runId)}`;
    const series = new Map(); // metric name -> Map(step -> value)
    const charts = new Map(); // metric name -> {figure, root, value, scale}
    let lastStep = 0, lastSeq = -1, first = true, events = [];

    const title = el("h1");
    const info = el("dl", { class: "info" });
    const chartGrid = el("div", { class: "charts", id: "charts" });
    const snapshots = table("snapshots", ["id", "kind", "step", "label", "age", "size", "export / resume"]);
    const evals = table("evals", ["id", "name", "model", "env", "status", "samples", "pass@1", "mean reward", "step", "age"]);
    const eventList = table("events", ["seq", "time", "event", "fields"]);
    main().replaceChildren(title, info, el("h2", {}, "Metrics"), chartGrid, el("h2", {}, "Snapshots"), snapshots.node,
      el("h2", {}, "Evals"), evals.node, el("h2", {}, "Events ", el("span", { class: "muted" }, `(newest ${MAX_EVENTS})`)), eventList.node);

    const chartFor = (name) => {
      if (!charts.has(name)) {
        const root = svg("svg", { class: "plot", role: "img", "aria-label": name });
        const value = el("span", { class: "value" });
        const chart = { root, value, scale: null, points: [] };
        chart.figure = el("figure", { class: "chart", "data-metric": name }, el("figcaption", {}, el("span", { class: "name" }, name), value), root);
        followCursor(root, () => chart.scale, (step) => {
          const point = step === null ? null : nearest(chart.points, step);
          value.textContent = point ? `${num(point[1])} @ ${point[0]}` : lastValueText(chart.points);
          return point ? point[0] : null;
        });
        charts.set(name, chart);
        chartGrid.append(...metricOrder(charts.keys()).map((n) => charts.get(n).figure));
      }
      return charts.get(name);
    };
    const lastValueText = (points) => {
      const last = [...points].reverse().find((p) => p[1] !== null);
      return last ? `${num(last[1])} @ ${last[0]}` : "";
    };

    poll(async () => {
      const run = await api(base); // the status first: once it is final, this poll drains the rest
      const eventsPath = first ? `${base}/events?tail=true&limit=${MAX_EVENTS}` : `${base}/events?after_seq=${lastSeq}&limit=1000`;
      const [metrics, newEvents, snaps, runEvals] = await Promise.all([
        api(`${base}/metrics?since=${lastStep}`), api(eventsPath), api(`${base}/snapshots`),
        api(`/api/evals?run_id=${encodeURIComponent(run.id)}`)]);
      first = false;
      renderHeader(run, title, info);
      for (const [name, points] of Object.entries(metrics.series)) {
        if (!series.has(name)) series.set(name, new Map());
        for (const [step, value] of points) series.get(name).set(step, value);
        const sorted = [...series.get(name)].sort((a, b) => a[0] - b[0]);
        const chart = chartFor(name);
        chart.points = sorted;
        chart.scale = drawChart(chart.root, [{ label: name, color: COLORS[0], points: sorted }]);
        chart.value.textContent = lastValueText(sorted);
      }
      if (metrics.last_step !== null) lastStep = Math.max(lastStep, metrics.last_step);
      if (!charts.size) chartGrid.replaceChildren(el("p", { class: "muted" }, "No metrics yet."));
      snapshots.body.replaceChildren(...snaps.snapshots.map((s) => el("tr", { class: "snapshot-row" },
        el("td", { class: "mono", title: s.id }, s.short_id), el("td", {}, s.kind), el("td", { class: "num" }, s.step),
        el("td", {}, s.label || ""), el("td", {}, age(s.age_s)), el("td", { class: "num" }, bytes(s.size_bytes)),
        el("td", { class: "commands" }, s.export_command ? copyable(s.export_command) : "",
          s.resume_command ? copyable(s.resume_command) : ""))));
      evals.body.replaceChildren(...runEvals.evals.map(evalRow(false)));
      if (newEvents.events.length) {
        lastSeq = newEvents.events[newEvents.events.length - 1].seq;
        events = events.concat(newEvents.events).slice(-MAX_EVENTS);
        eventList.body.replaceChildren(...[...events].reverse().map((e) => {
          const fields = JSON.stringify(e.fields);
          return el("tr", { class: "event-row" }, el("td", { class: "num" }, e.seq), el("td", {}, clock(e.time)),
            el("td", {}, e.name), el("td", { class: "mono fields", title: fields.length > 240 ? fields : null },
              fields.length > 240 ? `${fields.slice(0, 240)}…` : fields));
        }));
      }
      return !run.terminal || newEvents.events.length === 1000;
    }, POLL_MS);
  }

  function renderHeader(run, title, info) {
    document.title = `${run.name || run.id.slice(0, 10)} · rollout dashboard`;
    title.replaceChildren(run.name ? `${run.name} ` : "", el("span", { class: "mono muted" }, run.id), " ", statusBadge(run.status, run.error));
    const rows = [
      ["algorithm", run.algorithm],
      ["created", `${timestamp(run.created_at)} (${age(run.age_s)})`],
      ["started", timestamp(run.started_at)],
      ["ended", timestamp(run.ended_at)],
      ["duration", duration(run.duration_s)],
      ["last step", run.last_step ?? ""],
    ];
    if (["running", "crashed"].includes(run.status) && run.heartbeat_at) rows.push(["heartbeat", timestamp(run.heartbeat_at)]);
    if (run.error) rows.push(["error", el("span", { class: "error" }, run.error)]);
    if (run.resumed_from) rows.push(["resumed from", el("span", { class: "mono" }, run.resumed_from)]);
    if (run.resume_command) rows.push(["resume with", copyable(run.resume_command)]);
    rows.push(["config digest", el("span", { class: "mono" }, run.config_digest.slice(0, 16))]);
    const shown = rows.filter(([, value]) => value !== "");
    info.replaceChildren(...shown.flatMap(([key, value]) => [el("dt", {}, key), el("dd", {}, value)]));
  }

  // ------------------------------------------------------------------ page: compare

  function compareView() {
    document.title = "compare · rollout dashboard";
    const params = new URLSearchParams(location.search);
    const ids = (params.get("runs") || "").split(",").filter(Boolean).slice(0, COLORS.length);
    if (!ids.length) {
      main().replaceChildren(el("p", { class: "error" }, "Pick runs to compare on the runs page (/compare?runs=ID,ID)."));
      return;
    }
    const picker = el("select", { id: "metric" });
    const legend = el("ul", { class: "legend" });
    const root = svg("svg", { class: "plot", role: "img", "data-width": 900, "data-height": 360 });
    const chart = { scale: null, lines: [] };
    main().replaceChildren(el("div", { class: "bar" }, el("h1", {}, "Compare runs"), el("label", {}, "metric ", picker)),
      el("figure", { class: "chart compare" }, root, legend));
    let metric = params.get("metric"), runs = [];
    picker.addEventListener("change", () => {
      metric = picker.value;
      params.set("metric", metric);
      history.replaceState(null, "", `/compare?${params}`);
      refresh();
    });
    followCursor(root, () => chart.scale, (step) => {
      renderLegend(step);
      const shown = step === null ? null : nearest(chart.lines.flatMap((l) => l.points), step);
      return shown ? shown[0] : null;
    });
    const renderLegend = (step) => legend.replaceChildren(...chart.lines.map((line, i) => {
      const point = step === null ? [...line.points].reverse().find((p) => p[1] !== null) : nearest(line.points, step);
      const run = runs[i];
      return el("li", { "data-run-id": run.id }, el("span", { class: "swatch", "data-color": line.color }),
        runLink(run.id, run.name ? `${run.name} (${run.id.slice(0, 10)})` : run.id.slice(0, 10)), ` ${run.algorithm} `,
        statusBadge(run.status),
        el("span", { class: "value" }, point ? ` ${num(point[1])} @ ${point[0]}` : line.points.length ? "" : " (not logged)"));
    }));
    const refresh = async () => {
      runs = await Promise.all(ids.map((id) => api(`/api/runs/${encodeURIComponent(id)}`)));
      const names = metricOrder(new Set(runs.flatMap((r) => r.metric_names)));
      if (!metric || !names.includes(metric)) metric = names[0] || null;
      picker.replaceChildren(...names.map((n) => el("option", { value: n, selected: n === metric ? "" : null }, n)));
      const wanted = metric;
      const data = wanted ? await Promise.all(runs.map((r) => api(`/api/runs/${r.id}/metrics?name=${encodeURIComponent(wanted)}`))) : [];
      if (wanted !== metric) return true;  // the picker changed meanwhile: that refresh draws
      chart.lines = runs.map((r, i) => ({ label: r.id, color: COLORS[i], points: data.length ? data[i].series[wanted] || [] : [] }));
      chart.scale = drawChart(root, chart.lines);
      root.setAttribute("aria-label", wanted || "no metrics");  // labelled once its lines are drawn
      renderLegend(null);
      for (const swatch of legend.querySelectorAll(".swatch")) swatch.style.background = swatch.dataset.color;
      return runs.some((r) => !r.terminal);
    };
    poll(refresh, POLL_MS);
  }

  // ------------------------------------------------------------------ route

  takeKeyFromFragment();
  const runMatch = location.pathname.match(/^\/runs\/([^/]+)$/);
  if (runMatch) runView(decodeURIComponent(runMatch[1]));
  else if (location.pathname === "/compare") compareView();
  else indexView();
})();
