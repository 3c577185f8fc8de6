// Charts drawn as inline SVG from figures the console polls: a bounded
// ring of samples per chart, a line per series, a few grid lines. The
// colours come from style.css (classes s0, s1, ...), not from the data.

import { h, time } from './dom.js';

const SVG = 'http://www.w3.org/2000/svg';

/** The last `size` samples, oldest first. */
export class Ring {
  constructor(size) {
    this.size = size;
    this.items = [];
  }

  push(item) {
    this.items.push(item);
    if (this.items.length > this.size) this.items.shift();
  }
}

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  if (text !== undefined) el.textContent = text;
  return el;
}

/** A round upper bound for an axis: 1, 2 or 5 times a power of ten. */
function ceiling(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((step) => step * power).find((bound) => bound >= value);
}

/** A round upper bound for bytes: a power of two (quarters of it are round too). */
function ceilingBytes(value) {
  let bound = 1024;
  while (bound < value) bound *= 2;
  return bound;
}

/**
 * A line chart of `samples` (objects with `t`, milliseconds, and one
 * field per series). `series`: [{key, label, dashed}]; `format` writes
 * a value; `bytes` rounds the axis to binary units.
 */
export function lineChart({ title, samples, series, format = String, bytes = false }) {
  const width = 480;
  const height = 170;
  const left = 62;
  const right = 10;
  const top = 10;
  const bottom = 22;
  const plotW = width - left - right;
  const plotH = height - top - bottom;
  const chart = svg('svg', { viewBox: `0 0 ${width} ${height}`, class: 'chart', role: 'img', 'aria-label': title });

  const values = samples.flatMap((s) => series.map((line) => s[line.key]).filter((v) => typeof v === 'number'));
  const top_ = Math.max(0, ...values);
  const max = bytes ? ceilingBytes(top_) : ceiling(top_);
  const t0 = samples.length ? samples[0].t : 0;
  const t1 = samples.length ? samples[samples.length - 1].t : 1;
  // The samples kept, first to last (at least 10 s, so that two close samples are not a wall).
  const span = Math.max(t1 - t0, 10_000);
  const x = (t) => left + ((t - (t1 - span)) / span) * plotW;
  const y = (v) => top + plotH - (v / max) * plotH;

  // Fifths of 1, 2, 5 or 10 times a power of ten are round; so are quarters of a power of two.
  const steps = bytes ? 4 : 5;
  for (let i = 0; i <= steps; i += 1) {
    const value = (max * i) / steps;
    chart.append(svg('line', { x1: left, x2: width - right, y1: y(value), y2: y(value), class: 'grid' }));
    chart.append(svg('text', { x: left - 6, y: y(value) + 4, class: 'axis', 'text-anchor': 'end' }, format(value)));
  }
  chart.append(svg('text', { x: left, y: height - 6, class: 'axis' }, samples.length ? time(t1 - span) : ''));
  chart.append(svg('text', { x: width - right, y: height - 6, class: 'axis', 'text-anchor': 'end' },
    samples.length ? time(t1) : ''));

  if (samples.length < 2) {
    chart.append(svg('text', { x: left + plotW / 2, y: top + plotH / 2, class: 'axis', 'text-anchor': 'middle' },
      'collecting samples…'));
  }
  series.forEach((line, i) => {
    const points = samples
      .filter((s) => typeof s[line.key] === 'number')
      .map((s) => `${x(s.t).toFixed(1)},${y(s[line.key]).toFixed(1)}`);
    if (points.length === 0) return;
    const cls = `line s${i}${line.dashed ? ' dashed' : ''}`;
    chart.append(svg('polyline', { points: points.join(' '), class: cls }));
  });

  const last = samples[samples.length - 1] || {};
  const legend = h('div', { class: 'legend' }, series.map((line, i) => h('span', { class: 'legend-item' },
    h('span', { class: `swatch s${i}${line.dashed ? ' dashed' : ''}` }),
    `${line.label} `, h('b', {}, typeof last[line.key] === 'number' ? format(last[line.key]) : '–'))));
  return h('figure', { class: 'chart-box' }, h('figcaption', {}, title), chart, legend);
}

/**
 * A horizontal bar: `parts` ([{label, value}]) stacked against `total`
 * (the budget), with the budget marked. Parts past the budget overflow
 * the mark, which is the point: it shows how far over it is.
 */
export function budgetBar({ parts, total, format }) {
  const width = 560;
  const height = 26;
  const sum = parts.reduce((n, part) => n + part.value, 0);
  const scale = Math.max(total, sum, 1);
  // Rectangles only: stretched to the box's width.
  const bar = svg('svg', { viewBox: `0 0 ${width} ${height}`, class: 'bar', role: 'img', preserveAspectRatio: 'none' });
  bar.append(svg('rect', { x: 0, y: 4, width, height: height - 8, class: 'bar-bg', rx: 3 }));
  let at = 0;
  parts.forEach((part, i) => {
    const w = (part.value / scale) * width;
    bar.append(svg('rect', { x: at, y: 4, width: Math.max(w, 0), height: height - 8, class: `bar-part s${i}` }));
    at += w;
  });
  if (total > 0) {
    const mark = (total / scale) * width;
    bar.append(svg('line', { x1: mark, x2: mark, y1: 0, y2: height, class: 'bar-mark' }));
  }
  const legend = h('div', { class: 'legend' },
    parts.map((part, i) => h('span', { class: 'legend-item' }, h('span', { class: `swatch s${i}` }),
      `${part.label} `, h('b', {}, format(part.value)))),
    total > 0 ? h('span', { class: 'legend-item' }, h('span', { class: 'swatch mark' }), 'budget ', h('b', {}, format(total))) : null);
  return h('div', { class: 'bar-box' }, bar, legend);
}
