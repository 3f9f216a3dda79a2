// A small SVG line chart for training curves: step against train and eval
// loss. Redrawn whole on each update; points are thinned to stay cheap.
import { svg } from './dom.js';

const W = 640;
const H = 240;
const PAD = { left: 52, right: 16, top: 14, bottom: 30 };
const MAX_POINTS = 600;

function niceTicks(lo, hi, count = 5) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) ?? raw;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

function thin(points) {
  if (points.length <= MAX_POINTS) return points;
  const every = points.length / MAX_POINTS;
  const out = [];
  for (let i = 0; i < MAX_POINTS; i++) out.push(points[Math.floor(i * every)]);
  out.push(points[points.length - 1]);
  return out;
}

// series: [{name, cls, points: [[x, y], ...], dots}]
export function lineChart(series, { xLabel = 'step', yLabel = 'loss' } = {}) {
  const all = series.flatMap((s) => s.points);
  const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', preserveAspectRatio: 'xMidYMid meet' });
  const summary = series.filter((s) => s.points.length)
    .map((s) => `${s.name} ${s.points[s.points.length - 1][1].toFixed(4)} at ${xLabel} ${s.points[s.points.length - 1][0]}`)
    .join('; ');
  root.setAttribute('aria-label', `${yLabel} by ${xLabel}: ${summary || 'no data yet'}`);
  if (!all.length) {
    root.append(svg('text', { x: W / 2, y: H / 2, class: 'chart-empty', 'text-anchor': 'middle' }, `no ${yLabel} reported yet`));
    return root;
  }
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  const pad = (y1 - y0) * 0.08 || Math.abs(y0) * 0.1 || 1;
  y0 = Math.max(0, y0 - pad);
  y1 += pad;
  const px = (x) => PAD.left + ((x - x0) / (x1 - x0)) * (W - PAD.left - PAD.right);
  const py = (y) => H - PAD.bottom - ((y - y0) / (y1 - y0)) * (H - PAD.top - PAD.bottom);

  const grid = svg('g', { class: 'chart-grid' });
  for (const t of niceTicks(y0, y1)) {
    if (t < y0 || t > y1) continue;
    grid.append(svg('line', { x1: PAD.left, x2: W - PAD.right, y1: py(t), y2: py(t) }));
    grid.append(svg('text', { x: PAD.left - 6, y: py(t) + 4, 'text-anchor': 'end' }, String(t)));
  }
  for (const t of niceTicks(x0, x1, 6)) {
    if (t < x0 || t > x1) continue;
    grid.append(svg('text', { x: px(t), y: H - PAD.bottom + 16, 'text-anchor': 'middle' }, String(t)));
  }
  grid.append(svg('text', { x: W - PAD.right, y: H - 4, 'text-anchor': 'end', class: 'chart-axis-label' }, xLabel));
  root.append(grid);
  root.append(svg('line', { class: 'chart-axis', x1: PAD.left, x2: PAD.left, y1: PAD.top, y2: H - PAD.bottom }));
  root.append(svg('line', { class: 'chart-axis', x1: PAD.left, x2: W - PAD.right, y1: H - PAD.bottom, y2: H - PAD.bottom }));

  series.forEach((s, i) => {
    if (!s.points.length) return;
    const pts = thin(s.points);
    root.append(svg('polyline', { class: `chart-line ${s.cls}`, points: pts.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(' ') }));
    if (s.dots) {
      for (const [x, y] of pts) {
        root.append(svg('circle', { class: `chart-dot ${s.cls}`, cx: px(x).toFixed(1), cy: py(y).toFixed(1), r: 3 },
          svg('title', {}, `${xLabel} ${x}: ${y.toFixed(4)}`)));
      }
    }
    // legend, top right
    const lx = W - PAD.right - 110;
    const ly = PAD.top + 6 + i * 16;
    root.append(svg('line', { class: `chart-line ${s.cls}`, x1: lx, x2: lx + 18, y1: ly, y2: ly }));
    root.append(svg('text', { class: 'chart-legend', x: lx + 24, y: ly + 4 }, s.name));
  });
  return root;
}

// Train / eval loss points from job events (finetune reports `loss` and `eval_loss` with `step`).
export function lossSeries(events) {
  const train = [];
  const evalPts = [];
  for (const e of events) {
    const d = e.data || {};
    const step = d.step ?? d.global_step;
    if (typeof step !== 'number') continue;
    if (typeof d.loss === 'number' && isFinite(d.loss)) train.push([step, d.loss]);
    if (typeof d.eval_loss === 'number' && isFinite(d.eval_loss)) evalPts.push([step, d.eval_loss]);
  }
  return [
    { name: 'train loss', cls: 'train', points: train },
    { name: 'eval loss', cls: 'eval', points: evalPts, dots: true },
  ];
}
