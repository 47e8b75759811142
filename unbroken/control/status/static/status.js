// The unbroken status page: long-polls api/status and draws the snapshot (unbroken.control.status.server.RunView).
// Charts are uPlot (vendored, static/uPlot.iife.min.js); every value from the run is put in the page as text
// (textContent), never as HTML.
"use strict";

const COLORS = { loss: "#1f6feb", val: "#d97706", stepTime: "#8250df", alive: "#57606a", failure: "#d1242f", rejoin: "#1a7f37" };
const LONG_POLL_S = 20;
const RETRY_MS = 3000;
const TERMINAL = new Set(["finished", "stopped", "failed", "coordinator_lost"]);

// The token: from ?token= (then kept for this tab only and taken out of the address bar) or from earlier.
const token = (() => {
  const params = new URLSearchParams(window.location.search);
  const given = params.get("token");
  if (given) {
    sessionStorage.setItem("unbroken-token", given);
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", window.location.pathname + (rest ? "?" + rest : ""));
    return given;
  }
  return sessionStorage.getItem("unbroken-token");
})();

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, cls) {
  const tr = el("tr", null, cls);
  for (const c of cells) tr.appendChild(el("td", c));
  return tr;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

const fmt = {
  num: (x, digits = 4) => (x === null || x === undefined ? "-" : Number(x).toFixed(digits)),
  int: (x) => (x === null || x === undefined ? "-" : Number(x).toLocaleString()),
  ms: (s) => (s === null || s === undefined ? "-" : `${(s * 1000).toFixed(0)} ms`),
  secs: (s) => {
    if (s === null || s === undefined) return "-";
    if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
    if (s < 120) return `${s.toFixed(1)} s`;
    if (s < 7200) return `${(s / 60).toFixed(1)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  },
  clock: (t) => (t === null || t === undefined ? "-" : new Date(t * 1000).toLocaleTimeString()),
  // A checkpoint is named by the steps done: step_00000008.pt holds the state after step 7 (steps count from 0).
  after: (stepsDone) => (stepsDone === null || stepsDone === undefined ? "-" : stepsDone > 0 ? `after step ${stepsDone - 1}` : "before step 0"),
};

// -- charts -------------------------------------------------------------------------------------------------
let markers = [];

// Dashed vertical lines at each failure (red) and rejoin (green), drawn by uPlot's draw hook.
function markersPlugin() {
  return {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          const { left, top, width, height } = u.bbox;
          ctx.save();
          ctx.lineWidth = 1.5 * devicePixelRatio;
          ctx.setLineDash([5 * devicePixelRatio, 4 * devicePixelRatio]);
          ctx.font = `${11 * devicePixelRatio}px sans-serif`;
          for (const m of markers) {
            const x = Math.round(u.valToPos(m.step, "x", true));
            if (!Number.isFinite(x) || x < left || x > left + width) continue;
            ctx.strokeStyle = ctx.fillStyle = m.color;
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, top + height);
            ctx.stroke();
            ctx.fillText(m.label, x + 3 * devicePixelRatio, top + 12 * devicePixelRatio);
          }
          ctx.restore();
        },
      ],
    },
  };
}

function chartWidth(container) {
  return Math.max(300, container.clientWidth || 800);
}

let lossChart = null;
let timeChart = null;
let goodputChart = null;

// The badput buckets of unbroken.core.goodput.Bucket, bottom of the stack first (unattributed, which can be
// negative, is left out of the stack and said in the note).
const BUCKETS = [
  ["start", "#8c959f"], ["restart", "#57606a"], ["detection", "#d1242f"], ["reformation", "#fb8f44"],
  ["recompute", "#bf8700"], ["transfer", "#1a7f37"], ["workers_down", "#cf222e"], ["slow", "#8250df"],
  ["checkpoint", "#1f6feb"], ["evaluation", "#0969da"], ["nonfinite", "#d97706"], ["coordinator", "#6e7781"],
];

// Stacked: series k is the sum of buckets 0..k, drawn from the top of the stack down, each filled to zero.
function goodputData(s) {
  const g = s.goodput;
  const stacks = [];
  let below = g.step.map(() => 0);
  for (const [name] of BUCKETS) {
    below = below.map((x, i) => x + Math.max(0, g[name]?.[i] ?? 0));
    stacks.push(below);
  }
  return [g.step, ...stacks.reverse()];
}

function lossData(s) {
  const train = new Map(s.series.step.map((step, i) => [step, s.series.loss[i]]));
  const val = new Map(s.eval.step.map((step, i) => [step, s.eval.val_loss[i]]));
  const steps = [...new Set([...train.keys(), ...val.keys()])].sort((a, b) => a - b);
  return [steps, steps.map((x) => (train.has(x) ? train.get(x) : null)), steps.map((x) => (val.has(x) ? val.get(x) : null))];
}

function timeData(s) {
  const ms = s.series.step_time_s.map((x) => (x === null ? null : x * 1000));
  return [s.series.step, ms, s.series.alive];
}

function drawCharts(s) {
  markers = [];
  for (const inc of s.incidents) {
    markers.push({ step: inc.step, color: COLORS.failure, label: `w${inc.worker} failed` });
    if (inc.rejoin_step !== null) markers.push({ step: inc.rejoin_step, color: COLORS.rejoin, label: `w${inc.worker} back` });
  }
  const lossBox = $("loss-chart");
  const timeBox = $("time-chart");
  if (lossChart === null) {
    lossChart = new uPlot(
      {
        width: chartWidth(lossBox),
        height: 280,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, { label: "loss" }],
        series: [
          { label: "step" },
          { label: "train loss", stroke: COLORS.loss, width: 2, spanGaps: true },
          { label: "validation loss", stroke: COLORS.val, width: 2, spanGaps: true, points: { show: true, size: 6 } },
        ],
        plugins: [markersPlugin()],
      },
      lossData(s),
      lossBox,
    );
    timeChart = new uPlot(
      {
        width: chartWidth(timeBox),
        height: 220,
        scales: { x: { time: false }, alive: { range: (u, lo, hi) => [0, Math.max(1, hi) + 1] } },
        axes: [{ label: "step" }, { label: "ms" }, { label: "alive", scale: "alive", side: 1, grid: { show: false } }],
        series: [
          { label: "step" },
          { label: "step time (ms)", stroke: COLORS.stepTime, width: 1.5, spanGaps: false },
          { label: "workers alive", stroke: COLORS.alive, width: 1.5, scale: "alive", paths: uPlot.paths.stepped({ align: 1 }) },
        ],
        plugins: [markersPlugin()],
      },
      timeData(s),
      timeBox,
    );
    window.addEventListener("resize", () => {
      lossChart.setSize({ width: chartWidth(lossBox), height: 280 });
      timeChart.setSize({ width: chartWidth(timeBox), height: 220 });
    });
  } else {
    lossChart.setData(lossData(s));
    timeChart.setData(timeData(s));
  }
  drawGoodput(s);
}

function drawGoodput(s) {
  const g = s.goodput;
  const n = g ? g.step.length : 0;
  if (n === 0) {
    $("goodput-note").textContent = "No goodput record yet (one every metrics.goodput_every committed steps).";
    return;
  }
  const ratio = g.ratio[n - 1];
  const rate = g.tokens_per_s[n - 1];
  const unattributed = g.unattributed[n - 1];
  $("goodput-note").textContent =
    `${fmt.int(rate === null ? null : Math.round(rate))} tokens/s committed, ` +
    `${ratio === null ? "-" : (100 * ratio).toFixed(1) + " %"} of the ideal ` +
    `${fmt.int(g.ideal_tokens_per_s[n - 1] === null ? null : Math.round(g.ideal_tokens_per_s[n - 1]))}; ` +
    `badput seconds so far by cause, stacked (unattributed: ${fmt.secs(unattributed)}).`;
  const box = $("goodput-chart");
  if (goodputChart === null) {
    goodputChart = new uPlot(
      {
        width: chartWidth(box),
        height: 220,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, { label: "badput s" }],
        series: [{ label: "step" }, ...[...BUCKETS].reverse().map(([name, color]) => ({ label: name, stroke: color, fill: color, width: 1 }))],
      },
      goodputData(s),
      box,
    );
    window.addEventListener("resize", () => goodputChart.setSize({ width: chartWidth(box), height: 220 }));
  } else {
    goodputChart.setData(goodputData(s));
  }
}

// -- tables -------------------------------------------------------------------------------------------------
function card(k, v) {
  const c = el("div", null, "card");
  c.appendChild(el("div", k, "k"));
  c.appendChild(el("div", v, "v"));
  return c;
}

function drawSummary(s) {
  const r = s.run;
  $("state").textContent = r.state + (r.state_detail ? `: ${r.state_detail}` : "");
  $("state").className = `badge ${r.state}`;
  $("run-dir").textContent = r.run_dir || "";
  const ckpt = r.last_checkpoint;
  const ago = r.updated_at === null ? "-" : `${fmt.secs(Math.max(0, s.server_time - r.updated_at))} ago`;
  $("summary").replaceChildren(
    card("steps done", r.total_steps ? `${fmt.int(r.steps_done)} / ${fmt.int(r.total_steps)}` : fmt.int(r.steps_done)),
    card("last step", r.last_step === null || r.last_step === undefined ? "-" : fmt.int(r.last_step)),
    card("epoch", r.epoch),
    card("workers alive", r.expected_workers ? `${r.alive} / ${r.expected_workers}` : r.alive),
    card("train loss", fmt.num(r.loss)),
    card("validation loss", fmt.num(r.val_loss)),
    card("step time (median)", fmt.ms(r.step_time_s)),
    card("tokens / s (median)", fmt.int(r.tokens_per_s === null ? null : Math.round(r.tokens_per_s))),
    ...(r.tokens_per_s_per_gpu === null || r.tokens_per_s_per_gpu === undefined ? [] : [
      card("tokens / s per GPU", fmt.int(Math.round(r.tokens_per_s_per_gpu))),
      card("MFU", r.mfu === null ? "-" : `${(100 * r.mfu).toFixed(1)} %`),
    ]),
    card("tokens", fmt.int(r.tokens)),
    ...(r.train_tokens_per_s === null || r.train_tokens_per_s === undefined ? [] : [
      card("tokens / s (training)", fmt.int(Math.round(r.train_tokens_per_s))),
      card("wall time", fmt.secs(r.wall_s)),
    ]),
    ...(!s.goodput || s.goodput.step.length === 0 ? [] : [
      card("goodput (of the ideal)", s.goodput.ratio.at(-1) === null ? "-" : `${(100 * s.goodput.ratio.at(-1)).toFixed(1)} %`),
    ]),
    // a spare's join is its promotion (the spares card), not a rejoin
    card("failed / recovered / rejoined", `${r.failures} / ${r.recoveries} / ${r.rejoins ?? r.joins ?? 0}`),
    card("recomputed / dropped", `${r.recomputed_microbatches} / ${r.dropped_microbatches}`),
    ...(!r.spares || r.spares.started + r.spares.ready + r.spares.promoted === 0 ? [] : [
      card("spares starting / ready / promoted", `${r.spares.started} / ${r.spares.ready} / ${r.spares.promoted}`),
    ]),
    card("last checkpoint", ckpt ? fmt.after(ckpt.step) : "-"),
    card("last record", ago),
  );
}

function drawWorkers(s) {
  fill(
    $("workers").tBodies[0],
    s.workers.map((w) =>
      row(
        [
          w.id,
          w.state + (w.fail_slow ? " (fail-slow)" : w.straggler ? " (straggler)" : ""),
          fmt.clock(w.since),
          w.quota ?? "-",
          w.s_per_microbatch === null ? "-" : w.s_per_microbatch.toFixed(3),
          w.compute_s === null ? "-" : w.compute_s.toFixed(3),
          w.failures,
          w.last_failure ?? "",
        ],
        `${w.state}${w.fail_slow || w.straggler ? " straggler" : ""}`,
      ),
    ),
  );
  const timed = s.workers.some((w) => w.s_per_microbatch !== null);
  $("workers-note").textContent = timed
    ? "Straggler: seconds per microbatch above 1.5x the median of the other members in the last step. " +
      "Fail-slow: slow by the windowed rule of docs/goodput.md (a slow record), until it recovers."
    : "The step records carry no per-worker timing (speeds); only each worker's share of the step is known.";
}

function drawIncidents(s) {
  const notBack = TERMINAL.has(s.run.state) ? "no (the run ended)" : "not yet";
  fill(
    $("incidents").tBodies[0],
    [...s.incidents].reverse().map((i) =>
      row([
        i.worker,
        `${i.event ?? ""} ${i.why ?? ""}`.trim(),
        `${fmt.clock(i.detected_at)} (${fmt.ms(i.detection_s)} after the fault), step ${i.step}`,
        i.reformed_at === null ? notBack : `${fmt.clock(i.reformed_at)} in ${fmt.ms(i.reform_s)}, step ${i.recovery_step}`,
        i.recomputed === null ? "-" : `${i.recomputed} / ${i.dropped}`,
        fmt.ms(i.recovery_step_time_s),
        i.rejoined_at === null ? notBack : `${fmt.clock(i.rejoined_at)}, epoch ${i.rejoin_epoch}, step ${i.rejoin_step}`,
        fmt.secs(i.down_s),
      ]),
    ),
  );
}

function drawTimeline(s) {
  const items = [...s.timeline].reverse().map((e) => {
    const li = el("li", null, e.kind);
    li.appendChild(el("span", fmt.clock(e.time), "when"));
    li.appendChild(document.createTextNode(e.text));
    return li;
  });
  if (s.timeline_dropped > 0) items.push(el("li", `... ${s.timeline_dropped} older events not kept`, "muted"));
  $("timeline").replaceChildren(...items);
}

function drawCheckpoints(s) {
  fill(
    $("checkpoints").tBodies[0],
    [...s.checkpoints].reverse().map((c) => row([fmt.after(c.step), fmt.clock(c.time), c.seconds === null ? "-" : c.seconds.toFixed(2), c.path])),
  );
}

function render(s) {
  drawSummary(s);
  drawWorkers(s);
  drawIncidents(s);
  drawTimeline(s);
  drawCheckpoints(s);
  drawCharts(s);
  document.body.dataset.seq = String(s.seq);
  document.body.dataset.state = s.run.state;
}

// -- polling ------------------------------------------------------------------------------------------------
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function poll() {
  let since = -1;
  for (;;) {
    try {
      const wait = since < 0 ? 0 : LONG_POLL_S;
      const response = await fetch(`api/status?since=${since}&wait=${wait}`, {
        headers: token ? { Authorization: `Bearer ${token}` } : {},
        cache: "no-store",
      });
      if (response.status === 401) {
        $("connection").textContent = "refused: open this page as http://HOST:PORT/?token=$UNBROKEN_TOKEN";
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const s = await response.json();
      $("connection").textContent = "";
      if (s.seq !== since) render(s);
      since = s.seq;
      if (TERMINAL.has(s.run.state)) return; // the run is over: its coordinator goes away
    } catch (e) {
      $("connection").textContent = `lost contact with the coordinator (${e.message}); retrying`;
      await sleep(RETRY_MS);
    }
  }
}

poll();
