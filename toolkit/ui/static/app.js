// difftune dashboard: plain JavaScript, no build step. Everything comes from the JSON API under /api/ (docs/ui.md),
// which reads the run folders' files; the page polls it.
'use strict';

const POLL_MS = 1500;
const COLORS = ['#d6452f', '#3d7be0', '#2f9e5b', '#9a46c9', '#d98a1c', '#1f9aa8', '#8a6d3b', '#c2407a'];
const UNITS = { time: 's/update', samples_per_s: 'samples/s', lr: 'learning rate', grad_norm: 'L2 norm' };
const NOT_SERIES = new Set(['step', 'epoch']);

const view = document.getElementById('view');
const tooltip = document.getElementById('tooltip');
let timer = null;       // the current page's poll
let page = null;        // the current page's state
let closeLightbox = null;

// ---- helpers ---------------------------------------------------------------------------------------------------

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options, credentials: 'same-origin', headers: { 'X-Difftune': '1', ...(options.headers || {}) },
  });
  const data = await response.json().catch(() => ({}));
  if (response.status === 401) {
    setConnection(false, 'this dashboard needs its token: open the address it printed');
  } else {
    setConnection(true);
  }
  if (!response.ok) {
    const error = new Error(data.error || `${response.status} ${response.statusText}`);
    error.status = response.status;
    error.data = data;
    throw error;
  }
  return data;
}

function setConnection(ok, why = 'dashboard not reachable') {
  const el = document.getElementById('connection');
  el.textContent = ok ? `updated ${new Date().toLocaleTimeString()}` : why;
  el.classList.toggle('lost', !ok);
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'class') node.className = value;
    else if (key === 'text') node.textContent = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : document.createTextNode(child));
  }
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

const runPath = (name) => `/api/runs/${encodeURIComponent(name)}`;
const runHash = (name, others = []) =>
  `#/run/${encodeURIComponent(name)}` + (others.length ? `?with=${others.map(encodeURIComponent).join(',')}` : '');

function formatNumber(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return '–';
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(2);
  return Number(value.toPrecision(4)).toString();
}

function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return '–';
  seconds = Math.round(seconds);
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
  return h ? `${h}h ${String(m).padStart(2, '0')}m` : m ? `${m}m ${String(s).padStart(2, '0')}s` : `${s}s`;
}

function stateBadge(state, note) {
  return el('span', { class: `state state-${state}`, title: note || null, 'data-state': state }, state);
}

function video(attrs) {
  // `muted` as a property too: browsers autoplay only muted videos, and the attribute alone does not set it
  const node = el('video', { autoplay: true, loop: true, muted: true, playsinline: true, ...attrs });
  node.muted = true;
  return node;
}

function sampleMedia(sample, attrs = {}) {
  if (sample.kind === 'video') return video({ src: sample.url, ...attrs });
  return el('img', { src: sample.url, alt: sample.prompt, loading: 'lazy', ...attrs });
}

function unitOf(name) {
  if (UNITS[name]) return UNITS[name];
  if (name.endsWith('_mib')) return 'MiB';
  if (name.startsWith('loss')) return 'loss';
  return '';
}

// ---- routing ---------------------------------------------------------------------------------------------------

function route() {
  if (closeLightbox) closeLightbox();
  clearTimeout(timer);
  timer = null;
  page = null;
  tooltip.hidden = true;
  const hash = location.hash || '#/';
  document.getElementById('nav-runs').classList.toggle('active', hash === '#/');
  document.getElementById('nav-queue').classList.toggle('active', hash.startsWith('#/queue'));
  const match = hash.match(/^#\/run\/([^?]+)(?:\?with=(.*))?$/);
  if (match) {
    const others = match[2] ? match[2].split(',').filter(Boolean).map(decodeURIComponent) : [];
    showRun(decodeURIComponent(match[1]), others);
  } else if (hash.startsWith('#/queue')) {
    showQueue();
  } else {
    showRuns();
  }
}

function poll(fn) {
  const token = {};
  page.token = token;
  const tick = async () => {
    if (page === null || page.token !== token) return;
    try {
      await fn();
    } catch (error) {
      if (error instanceof TypeError) setConnection(false);
      else console.error(error);
    }
    if (page !== null && page.token === token) timer = setTimeout(tick, POLL_MS);
  };
  tick();
}

// ---- runs page -------------------------------------------------------------------------------------------------

function showRuns() {
  page = { kind: 'runs', selected: new Set() };
  const body = el('tbody');
  const compare = el('button', {
    id: 'compare', type: 'button', disabled: true,
    onclick: () => { const [first, ...rest] = [...page.selected]; location.hash = runHash(first, rest); },
  }, 'Compare selected');
  view.replaceChildren(
    el('h1', { text: 'Runs' }),
    el('p', { class: 'note', id: 'training-folder' }),
    el('div', { class: 'toolbar' }, compare),
    el('div', { class: 'scroll' }, el('table', { class: 'list', id: 'runs' },
      el('thead', {}, el('tr', {}, ['', 'run', 'state', 'step', 'loss', 'speed', 'ETA', 'last sample']
        .map((h, i) => el('th', { class: i >= 5 && i < 7 ? 'num' : null }, h)))),
      body)),
    el('p', { id: 'no-runs', class: 'note', hidden: true, text: 'No runs in this folder yet: queue a job, or run one with python run.py.' }),
  );
  poll(async () => {
    const data = await api('/api/runs');
    document.getElementById('training-folder').textContent = `training folder: ${data.training_folder}`;
    document.getElementById('no-runs').hidden = data.runs.length > 0;
    // the last sample's element is kept while its file is the same (no reload, no flicker at every poll)
    const thumbs = new Map([...body.querySelectorAll('.thumb[src]')].map((node) => [node.getAttribute('src'), node]));
    body.replaceChildren(...data.runs.map((run) => runRow(run, thumbs)));
    compare.disabled = page.selected.size < 2;
  });
}

function runRow(run, thumbs) {
  const checkbox = el('input', {
    type: 'checkbox', checked: page.selected.has(run.name), 'aria-label': `select ${run.name}`,
    onchange: (event) => {
      if (event.target.checked) page.selected.add(run.name); else page.selected.delete(run.name);
      document.getElementById('compare').disabled = page.selected.size < 2;
    },
  });
  const fraction = run.total ? Math.min(run.step / run.total, 1) : 0;
  const thumb = run.thumbnail && thumbs.has(run.thumbnail) ? thumbs.get(run.thumbnail) : run.thumbnail
    ? (run.thumbnail.endsWith('.mp4') ? video({ class: 'thumb', src: run.thumbnail })
      : el('img', { class: 'thumb', src: run.thumbnail, alt: 'last sample' }))
    : el('span', { class: 'thumb' });
  const speed = run.seconds_per_update ? `${formatNumber(run.seconds_per_update)} s/update` : '–';
  return el('tr', { 'data-run': run.name, 'data-state': run.state },
    el('td', {}, checkbox),
    el('td', {}, el('a', { href: runHash(run.name) }, run.name),
      run.note ? el('div', { class: 'note' }, run.note) : null,
      run.last_error ? el('div', { class: 'note' }, run.last_error) : null),
    el('td', {}, stateBadge(run.state, run.note)),
    el('td', { class: 'num' }, `${run.step} / ${run.total || '?'}`, el('div', { class: 'bar' }, el('span', { style: `width:${(fraction * 100).toFixed(1)}%` }))),
    el('td', { class: 'num', 'data-field': 'loss' }, formatNumber(run.loss)),
    el('td', { class: 'num' }, speed, run.samples_per_s ? el('div', { class: 'note' }, `${formatNumber(run.samples_per_s)} samples/s`) : null),
    el('td', { class: 'num' }, run.state === 'running' ? formatDuration(run.eta_s) : '–'),
    el('td', {}, thumb),
  );
}

// ---- run page --------------------------------------------------------------------------------------------------

function showRun(name, others) {
  page = {
    kind: 'run', name, others, runs: new Map(), smoothing: 0.6, log: false, zoom: null, sampleStep: null,
    samplesKey: '', summary: null, allRuns: [],
  };
  for (const run of [name, ...others]) page.runs.set(run, { records: [], last: null, id: null });
  const message = el('div', { class: 'message', id: 'control-message' });
  const buttons = ['sample', 'save', 'stop'].map((action) => el('button', {
    type: 'button', id: `control-${action}`, class: action === 'stop' ? 'danger' : null, disabled: true,
    onclick: () => sendControl(action, message),
  }, { sample: 'Sample now', save: 'Save now', stop: 'Stop' }[action]));
  const smoothing = el('input', { type: 'range', min: 0, max: 0.99, step: 0.01, value: page.smoothing, id: 'smoothing',
    oninput: (e) => { page.smoothing = Number(e.target.value); smoothingValue.textContent = e.target.value; drawCharts(); } });
  const smoothingValue = el('span', { class: 'num' }, String(page.smoothing));
  const logScale = el('input', { type: 'checkbox', id: 'log-scale', onchange: (e) => { page.log = e.target.checked; drawCharts(); } });
  const zoomFrom = el('input', { type: 'number', id: 'zoom-from', placeholder: 'from', style: 'width:6em', onchange: zoomFromInputs });
  const zoomTo = el('input', { type: 'number', id: 'zoom-to', placeholder: 'to', style: 'width:6em', onchange: zoomFromInputs });
  view.replaceChildren(
    el('h1', { id: 'run-name' }, name, ' ', el('span', { id: 'run-state' })),
    el('p', { class: 'note', id: 'run-line' }),
    el('div', { class: 'toolbar' }, ...buttons, el('a', { href: `/runs/${encodeURIComponent(name)}/files/report.html`, target: '_blank', rel: 'noopener' }, 'report.html')),
    message,
    el('h2', { text: 'Curves' }),
    el('div', { class: 'toolbar' },
      el('label', {}, 'smoothing', smoothing, smoothingValue),
      el('label', {}, logScale, 'log scale'),
      el('label', {}, 'steps', zoomFrom, '–', zoomTo),
      el('button', { type: 'button', id: 'zoom-reset', onclick: () => setZoom(null) }, 'Reset zoom'),
      el('span', { class: 'note' }, 'drag across a chart to zoom; double-click resets')),
    el('div', { class: 'compare', id: 'compare-runs' }),
    el('div', { class: 'legend', id: 'legend' }),
    el('div', { class: 'charts', id: 'charts' }),
    el('h2', { text: 'Samples' }),
    el('div', { id: 'samples' }, el('p', { class: 'note', text: 'No samples yet.' })),
    el('h2', { text: 'Training plan' }), el('pre', { id: 'plan' }),
    el('h2', { text: 'Config' }), el('pre', { id: 'config' }),
  );
  poll(refreshRun);
  api('/api/runs').then((data) => { page.allRuns = data.runs.map((r) => r.name); drawCompare(); }).catch(() => {});
}

async function refreshRun() {
  const current = page;
  let changed = false;
  for (const [run, held] of current.runs) {
    const since = held.last === null ? '' : `?since=${held.last}`;
    const data = await api(runPath(run) + since);
    if (current !== page) return;
    if (held.last !== null && (data.metrics_id !== held.id || data.last_step < held.last)) {
      // metrics.jsonl was rewritten (a run continued from an older checkpoint cuts it back): start again
      held.records = [];
      held.last = null;
      held.id = null;
      changed = true;
      continue;
    }
    held.id = data.metrics_id;
    for (const record of data.metrics) held.records.push(record);
    if (data.metrics.length) changed = true;
    held.last = data.last_step;
    if (run === current.name) showRunDetail(data);
  }
  if (changed && !page.dragging) drawCharts();
  else if (changed) page.redrawAfterDrag = true;
}

function showRunDetail(data) {
  const summary = data.summary;
  page.summary = summary;
  document.getElementById('run-state').replaceChildren(stateBadge(summary.state, summary.note));
  const parts = [`step ${summary.step} / ${summary.total || '?'}`];
  if (summary.seconds_per_update) parts.push(`${formatNumber(summary.seconds_per_update)} s/update`);
  if (summary.state === 'running' && summary.eta_s) parts.push(`ETA ${formatDuration(summary.eta_s)}`);
  if (summary.checkpoint) parts.push(`last checkpoint ${summary.checkpoint}`);
  if (summary.note) parts.push(summary.note);
  if (summary.last_error) parts.push(`last error: ${summary.last_error}`);
  document.getElementById('run-line').textContent = parts.join(' · ');
  for (const action of ['sample', 'save', 'stop']) {
    document.getElementById(`control-${action}`).disabled = summary.state !== 'running';
  }
  const plan = data.plan ? Object.entries(data.plan).map(([k, v]) => `${k.padEnd(38)} ${v}`).join('\n') : '';
  setText('plan', plan);
  setText('config', data.config);
  const key = data.samples.map((s) => s.url).join('|');
  if (key !== page.samplesKey) {
    page.samplesKey = key;
    drawSamples(data.samples);
  }
}

function setText(id, text) {
  const node = document.getElementById(id);
  if (node.textContent !== text) node.textContent = text;
}

async function sendControl(action, message) {
  message.classList.remove('error');
  try {
    await api(`${runPath(page.name)}/control/${action}`, { method: 'POST' });
    message.textContent = `asked the run to ${action}: its trainer acts at its next update`;
  } catch (error) {
    message.classList.add('error');
    message.textContent = error.message;
  }
}

function drawCompare() {
  const box = document.getElementById('compare-runs');
  if (!box || page.allRuns.length < 2) return;
  box.replaceChildren('overlay: ', ...page.allRuns.filter((r) => r !== page.name).map((run) => el('label', {},
    el('input', {
      type: 'checkbox', checked: page.others.includes(run), 'data-compare': run,
      onchange: (e) => {
        const others = e.target.checked ? [...page.others, run] : page.others.filter((o) => o !== run);
        location.hash = runHash(page.name, others);
      },
    }), run)));
}

// ---- charts ----------------------------------------------------------------------------------------------------

function seriesNames() {
  const names = [];
  for (const held of page.runs.values()) {
    for (const record of held.records) {
      for (const [key, value] of Object.entries(record)) {
        if (!NOT_SERIES.has(key) && typeof value === 'number' && !names.includes(key)) names.push(key);
      }
    }
  }
  return names.sort((a, b) => b.startsWith('loss') - a.startsWith('loss'));  // stable: first seen first
}

function pointsOf(records, name) {
  const points = [];
  for (const record of records) {
    const value = record[name];
    if (typeof value === 'number' && Number.isFinite(value)) points.push([record.step, value]);
  }
  return points;
}

function smooth(points, weight) {
  // exponential moving average with a debiased start (as TensorBoard's smoothing slider)
  if (weight <= 0) return points;
  let level = 0, count = 0;
  return points.map(([step, value]) => {
    level = level * weight + (1 - weight) * value;
    count += 1;
    return [step, level / (1 - Math.pow(weight, count))];
  });
}

function niceTicks(low, high, count = 5) {
  if (!(high > low)) return [low];
  const raw = (high - low) / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || 10 * power;
  const ticks = [];
  for (let t = Math.ceil(low / step) * step; t <= high + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

function tickLabels(ticks, log) {
  // one notation for an axis: as many decimals (or exponent digits) as the tick spacing needs
  if (log || ticks.length < 2) return ticks.map(formatNumber);
  const step = Math.abs(ticks[1] - ticks[0]);
  const largest = Math.max(...ticks.map(Math.abs));
  const stepPower = Math.floor(Math.log10(step));
  if (largest !== 0 && (largest < 1e-3 || largest >= 1e5)) {
    const digits = Math.max(0, Math.floor(Math.log10(largest)) - stepPower);
    return ticks.map((t) => (t === 0 ? '0' : t.toExponential(digits)));
  }
  return ticks.map((t) => t.toFixed(Math.max(0, -stepPower)));
}

function extent(values) {
  // a loop, not Math.min(...values): spreading a long run's values overflows the call stack
  let low = Infinity, high = -Infinity;
  for (const value of values) {
    if (value < low) low = value;
    if (value > high) high = value;
  }
  return [low, high];
}

function valueRange(values, log) {
  let [low, high] = extent(values);
  if (log) { low = Math.log10(low); high = Math.log10(high); }
  const pad = high > low ? (high - low) * 0.06 : Math.max(Math.abs(low) * 0.05, 1e-9);
  return [low - pad, high + pad];  // a constant series sits in the middle, never on the frame
}

function drawCharts() {
  const box = document.getElementById('charts');
  if (!box) return;
  const names = seriesNames();
  const runs = [...page.runs.keys()];
  document.getElementById('legend').replaceChildren(...(runs.length > 1 ? runs.map((run, i) =>
    el('span', {}, el('i', { style: `background:${COLORS[i % COLORS.length]}` }), run)) : []));
  box.replaceChildren(...names.map((name) => chart(name, runs)));
  if (!names.length) box.append(el('p', { class: 'note', text: 'No metrics logged yet.' }));
}

function chart(name, runs) {
  const W = 560, H = 230, L = 58, R = 12, T = 10, B = 30;
  const shown = ([s, v]) => (!page.zoom || (s >= page.zoom[0] && s <= page.zoom[1])) && (!page.log || v > 0);
  const series = runs.map((run, i) => {
    const raw = pointsOf(page.runs.get(run).records, name);
    // smoothed over the whole run, then cut to the zoom: the smoothed line does not restart at the zoom's edge
    return { run, color: COLORS[i % COLORS.length], raw: raw.filter(shown), smooth: smooth(raw, page.smoothing).filter(shown) };
  });
  const all = series.flatMap((s) => s.raw);
  const figure = el('figure', { class: 'chart', 'data-chart': name });
  const unit = unitOf(name);
  figure.append(el('h3', {}, name, unit ? el('small', {}, ` (${unit}${page.log ? ', log scale' : ''})`) : null));
  const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': name });
  figure.append(root);
  if (!all.length) {
    root.append(Object.assign(svg('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'axis' }), { textContent: 'no points in range' }));
    return figure;
  }
  const [s0, s1] = page.zoom || extent(all.map(([s]) => s));
  const [v0, v1] = valueRange(all.map(([, v]) => v), page.log);
  const x = (step) => L + (s1 > s0 ? (step - s0) / (s1 - s0) : 0.5) * (W - L - R);
  const y = (value) => T + (1 - ((page.log ? Math.log10(value) : value) - v0) / (v1 - v0)) * (H - T - B);
  const grid = svg('g', { class: 'grid' });
  const axis = svg('g', { class: 'axis' });
  const yTicks = (page.log ? niceTicks(v0, v1, 4).map((t) => Math.pow(10, t)) : niceTicks(v0, v1, 4))
    .filter((tick) => y(tick) >= T - 0.5 && y(tick) <= H - B + 0.5);
  const yLabels = tickLabels(yTicks, page.log);
  yTicks.forEach((tick, i) => {
    const ty = y(tick);
    grid.append(svg('line', { x1: L, x2: W - R, y1: ty, y2: ty }));
    axis.append(Object.assign(svg('text', { x: L - 6, y: ty + 3, 'text-anchor': 'end', 'data-tick': 'y' }), { textContent: yLabels[i] }));
  });
  const xTicks = niceTicks(s0, s1, 5).filter((t) => Number.isInteger(t) || s1 - s0 < 5);
  for (const tick of xTicks) {
    const tx = x(tick);
    grid.append(svg('line', { x1: tx, x2: tx, y1: T, y2: H - B }));
    axis.append(Object.assign(svg('text', { x: tx, y: H - B + 14, 'text-anchor': 'middle', 'data-tick': 'x' }), { textContent: formatNumber(tick) }));
  }
  axis.append(Object.assign(svg('text', { x: W - R, y: H - 4, 'text-anchor': 'end' }), { textContent: 'step' }));
  root.append(grid, axis, svg('rect', { x: L, y: T, width: W - L - R, height: H - T - B, fill: 'none', stroke: '#d5dae4' }));
  for (const s of series) {
    const line = (points, css) => svg('polyline', {
      class: css, stroke: s.color, 'data-run': s.run, 'data-series': name, 'data-points': s.raw.length,
      points: decimate(points).map(([step, value]) => `${x(step).toFixed(1)},${y(value).toFixed(1)}`).join(' '),
    });
    if (page.smoothing > 0) root.append(line(s.raw, 'raw'));
    root.append(line(s.smooth, 'smooth'));
  }
  attachHover(root, figure, series, { x, y, s0, s1, L, R, W, H, T, B, name });
  return figure;
}

function decimate(points, limit = 1500) {
  if (points.length <= limit) return points;
  const stride = points.length / limit;
  const out = [];
  for (let i = 0; i < limit; i++) out.push(points[Math.floor(i * stride)]);
  out.push(points[points.length - 1]);
  return out;
}

function nearest(points, step) {
  let lo = 0, hi = points.length - 1;
  if (hi < 0) return null;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] < step) lo = mid + 1; else hi = mid;
  }
  if (lo > 0 && Math.abs(points[lo - 1][0] - step) <= Math.abs(points[lo][0] - step)) lo -= 1;
  return points[lo];
}

function attachHover(root, figure, series, g) {
  const cursor = svg('line', { class: 'cursor', y1: g.T, y2: g.H - g.B, visibility: 'hidden' });
  const brush = svg('rect', { class: 'brush', y: g.T, height: g.H - g.T - g.B, visibility: 'hidden' });
  root.append(cursor, brush);
  const toStep = (event) => {
    const box = root.getBoundingClientRect();
    const px = (event.clientX - box.left) / box.width * g.W;
    const clamped = Math.min(Math.max(px, g.L), g.W - g.R);
    return { px: clamped, step: g.s0 + (clamped - g.L) / (g.W - g.L - g.R) * (g.s1 - g.s0) };
  };
  let dragFrom = null;
  root.addEventListener('pointerdown', (event) => {
    dragFrom = toStep(event);
    page.dragging = true;  // no redraw under the pointer until it is released
    root.setPointerCapture(event.pointerId);
  });
  root.addEventListener('pointermove', (event) => {
    const at = toStep(event);
    cursor.setAttribute('x1', at.px); cursor.setAttribute('x2', at.px); cursor.setAttribute('visibility', 'visible');
    const lines = [];
    for (const s of series) {
      const point = nearest(page.smoothing > 0 ? s.smooth : s.raw, at.step);
      if (point) {
        const rawPoint = nearest(s.raw, point[0]);
        lines.push(`${series.length > 1 ? s.run + ': ' : ''}step ${point[0]}: ${formatNumber(rawPoint[1])}` +
          (page.smoothing > 0 ? ` (smoothed ${formatNumber(point[1])})` : ''));
      }
    }
    tooltip.textContent = `${g.name}\n`;
    tooltip.replaceChildren(el('strong', {}, g.name), ...lines.map((line) => el('div', {}, line)));
    tooltip.hidden = false;
    tooltip.style.left = `${event.clientX + 14}px`;
    tooltip.style.top = `${event.clientY + 10}px`;
    if (dragFrom) {
      brush.setAttribute('x', Math.min(dragFrom.px, at.px));
      brush.setAttribute('width', Math.abs(at.px - dragFrom.px));
      brush.setAttribute('visibility', 'visible');
    }
  });
  root.addEventListener('pointerup', (event) => {
    const at = toStep(event);
    if (dragFrom && Math.abs(at.px - dragFrom.px) > 6) {
      setZoom([Math.floor(Math.min(dragFrom.step, at.step)), Math.ceil(Math.max(dragFrom.step, at.step))]);
    }
    dragFrom = null;
    page.dragging = false;
    brush.setAttribute('visibility', 'hidden');
    if (page.redrawAfterDrag) { page.redrawAfterDrag = false; drawCharts(); }
  });
  root.addEventListener('pointercancel', () => { dragFrom = null; page.dragging = false; brush.setAttribute('visibility', 'hidden'); });
  root.addEventListener('pointerleave', () => { cursor.setAttribute('visibility', 'hidden'); tooltip.hidden = true; });
  root.addEventListener('dblclick', () => setZoom(null));
}

function setZoom(range) {
  page.zoom = range;
  document.getElementById('zoom-from').value = range ? range[0] : '';
  document.getElementById('zoom-to').value = range ? range[1] : '';
  tooltip.hidden = true;
  drawCharts();
}

function zoomFromInputs() {
  const from = Number(document.getElementById('zoom-from').value);
  const to = Number(document.getElementById('zoom-to').value);
  const fromSet = document.getElementById('zoom-from').value !== '', toSet = document.getElementById('zoom-to').value !== '';
  if (!fromSet && !toSet) return setZoom(null);
  page.zoom = [fromSet ? from : -Infinity, toSet ? to : Infinity];
  if (page.zoom[0] > page.zoom[1]) page.zoom.reverse();
  if (!Number.isFinite(page.zoom[0]) || !Number.isFinite(page.zoom[1])) {
    const [first, last] = extent([...page.runs.values()].flatMap((h) => h.records.map((r) => r.step)));
    page.zoom = [Number.isFinite(page.zoom[0]) ? page.zoom[0] : first, Number.isFinite(page.zoom[1]) ? page.zoom[1] : last];
  }
  drawCharts();
}

// ---- samples ---------------------------------------------------------------------------------------------------

function drawSamples(samples) {
  const box = document.getElementById('samples');
  if (!samples.length) {
    box.replaceChildren(el('p', { class: 'note', text: 'No samples yet.' }));
    return;
  }
  const steps = [...new Set(samples.map((s) => s.step))].sort((a, b) => a - b);
  const prompts = [...new Set(samples.map((s) => s.index))].sort((a, b) => a - b);
  const at = new Map(samples.map((s) => [`${s.index}:${s.step}`, s]));
  if (page.sampleStep === null || !steps.includes(page.sampleStep) || page.sampleStep === page.latestStep) {
    page.sampleStep = steps[steps.length - 1];  // follows the newest samples until the slider is moved back
  }
  page.latestStep = steps[steps.length - 1];
  const label = el('span', { class: 'num', id: 'sample-step-label' });
  const slider = el('input', {
    type: 'range', id: 'sample-step', min: 0, max: steps.length - 1, step: 1, value: steps.indexOf(page.sampleStep),
    oninput: (e) => { page.sampleStep = steps[Number(e.target.value)]; drawStrip(); },
  });
  const strip = el('div', { class: 'strip', id: 'sample-strip' });
  const table = el('table', { class: 'grid-samples', id: 'sample-grid' });
  const drawStrip = () => {
    label.textContent = `step ${page.sampleStep}`;
    strip.replaceChildren(...prompts.map((index) => {
      const sample = at.get(`${index}:${page.sampleStep}`);
      if (!sample) return null;
      return el('figure', { 'data-prompt': index }, referenceImages(sample),
        sampleMedia(sample, { onclick: () => openLightbox(sample, steps, at) }),
        el('figcaption', {}, `prompt ${index}: ${sample.prompt}`));
    }).filter(Boolean));
    for (const cell of table.querySelectorAll('td[data-step]')) cell.classList.toggle('current', Number(cell.dataset.step) === page.sampleStep);
  };
  table.append(el('tr', {}, el('th'), ...steps.map((step) => el('th', {}, `step ${step}`))));
  for (const index of prompts) {
    const newest = at.get(`${index}:${steps[steps.length - 1]}`) || {};
    table.append(el('tr', {}, el('th', { title: newest.prompt || '' }, `prompt ${index}`, referenceImages(newest)),
      ...steps.map((step) => {
        const sample = at.get(`${index}:${step}`);
        return el('td', { 'data-step': step }, sample ? sampleMedia(sample, { onclick: () => openLightbox(sample, steps, at) }) : null);
      })));
  }
  box.replaceChildren(el('div', { class: 'toolbar' }, el('label', {}, 'step', slider), label), strip,
    el('h3', { class: 'note', text: 'every prompt and step' }), el('div', { class: 'scroll' }, table));
  drawStrip();
}

// a sample's reference images (image-editing families), shown before its output
function referenceImages(sample) {
  const urls = sample.references || [];
  if (!urls.length) return null;
  return el('div', { class: 'references' }, ...urls.map((url, slot) =>
    el('img', { src: url, alt: `reference ${slot + 1}`, title: `reference ${slot + 1}`, class: 'reference' })));
}

function openLightbox(sample, steps, at) {
  const box = document.getElementById('lightbox');
  let current = sample;
  const show = () => {
    document.getElementById('lightbox-body').replaceChildren(current.kind === 'video'
      ? video({ src: current.url, controls: true })
      : el('img', { src: current.url, alt: current.prompt }));
    document.getElementById('lightbox-caption').textContent =
      `step ${current.step} · prompt ${current.index}: ${current.prompt} (← → other steps, Esc closes)`;
  };
  const move = (delta) => {
    const next = at.get(`${current.index}:${steps[steps.indexOf(current.step) + delta]}`);
    if (next) { current = next; show(); }
  };
  const onKey = (event) => {
    if (event.key === 'Escape') close();
    else if (event.key === 'ArrowRight') move(1);
    else if (event.key === 'ArrowLeft') move(-1);
  };
  const close = () => { box.hidden = true; document.removeEventListener('keydown', onKey); closeLightbox = null; };
  if (closeLightbox) closeLightbox();
  closeLightbox = close;
  document.getElementById('lightbox-close').onclick = close;
  box.onclick = (event) => { if (event.target === box) close(); };
  document.addEventListener('keydown', onKey);
  show();
  box.hidden = false;
}

// ---- queue page ------------------------------------------------------------------------------------------------

function showQueue() {
  page = { kind: 'queue', filename: 'job.yaml' };
  const text = el('textarea', { id: 'job-text', spellcheck: 'false', placeholder: 'paste a job file (YAML), or choose one' });
  const file = el('input', {
    type: 'file', id: 'job-file', accept: '.yaml,.yml,.json',
    onchange: async (e) => {
      const chosen = e.target.files[0];
      if (!chosen) return;
      page.filename = chosen.name;
      text.value = await chosen.text();
    },
  });
  const errors = el('ul', { class: 'errors', id: 'job-errors' });
  const message = el('div', { class: 'message', id: 'job-message' });
  const submit = el('button', { type: 'button', id: 'job-submit', onclick: () => submitJob(text.value, errors, message) }, 'Check and queue');
  const body = el('tbody');
  view.replaceChildren(
    el('h1', { text: 'Job queue' }),
    el('p', { class: 'note', id: 'queue-line' }),
    text, el('div', { class: 'toolbar' }, file, submit), message, errors,
    el('h2', { text: 'Jobs' }),
    el('div', { class: 'scroll' }, el('table', { class: 'list', id: 'jobs' },
      el('thead', {}, el('tr', {}, ['job', 'state', 'run', 'GPUs', 'submitted', 'note', ''].map((h) => el('th', {}, h)))), body)),
    el('pre', { id: 'job-log', hidden: true }),
  );
  poll(async () => {
    const data = await api('/api/jobs');
    document.getElementById('queue-line').textContent = data.runner
      ? `jobs run one at a time per GPU set (${data.gpu_sets.map((g) => g === null ? 'all visible devices' : `CUDA_VISIBLE_DEVICES=${g}`).join('; ')}), each as its own run.py process`
      : 'another dashboard runs this queue: this one shows it, starts nothing, and takes over when that one ends';
    body.replaceChildren(...data.jobs.map(jobRow));
  });
}

function jobRow(job) {
  const cancel = job.state === 'queued' ? el('button', {
    type: 'button', 'data-cancel': job.id,
    onclick: async () => { try { await api(`/api/jobs/${encodeURIComponent(job.id)}`, { method: 'DELETE' }); } catch (e) { alert(e.message); } },
  }, 'Cancel') : null;
  const showLog = el('button', { type: 'button', onclick: async () => {
    const data = await api(`/api/jobs/${encodeURIComponent(job.id)}`);
    const pre = document.getElementById('job-log');
    pre.hidden = false;
    pre.textContent = `${job.id}\n\n${data.log || '(no output yet)'}`;
  } }, 'Log');
  return el('tr', { 'data-job': job.id, 'data-state': job.state },
    el('td', {}, job.id),
    el('td', {}, stateBadge(job.state)),
    el('td', {}, job.run ? el('a', { href: runHash(job.run) }, job.run) : job.run_folder),
    el('td', {}, job.gpus === null ? '–' : job.gpus),
    el('td', { class: 'num' }, new Date(job.submitted_at * 1000).toLocaleString()),
    el('td', { class: 'note' }, job.note || ''),
    el('td', {}, cancel, ' ', showLog),
  );
}

async function submitJob(text, errors, message) {
  errors.replaceChildren();
  message.textContent = '';
  message.classList.remove('error');
  try {
    const data = await api(`/api/jobs?filename=${encodeURIComponent(page.filename)}`, {
      method: 'POST', body: text, headers: { 'Content-Type': 'application/yaml' },
    });
    message.textContent = `queued as ${data.job.id}`;
  } catch (error) {
    message.classList.add('error');
    if (error.data && error.data.errors) {
      message.textContent = 'not queued: fix these first';
      errors.replaceChildren(...error.data.errors.map((problem) =>
        el('li', { 'data-key': problem.key }, problem.key ? el('code', {}, problem.key) : null, problem.key ? ': ' : '', problem.message)));
    } else {
      message.textContent = error.message;
    }
  }
}

if (new URLSearchParams(location.search).has('token')) {
  // the token came in the address once (the answer set its cookie): it leaves the address bar and the history
  history.replaceState(null, '', location.pathname + location.hash);
}
window.addEventListener('hashchange', route);
route();
