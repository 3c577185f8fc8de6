// Small DOM helpers. Every string from the API goes into the page as text
// (textContent, or a text node through append), never as markup: a queue
// named "<img onerror=...>" shows as exactly that.

/** An element: h('a', {href: '#/x', class: 'y', onclick: f}, 'text', child, ...). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith('on')) el.addEventListener(key.slice(2), value);
    else if (key === 'class') el.className = value;
    else if (key === 'value') el.value = value;
    else if (key === 'checked') el.checked = Boolean(value);
    else el.setAttribute(key, value === true ? '' : String(value));
  }
  return append(el, ...children);
}

/** Appends nodes and texts (nested lists allowed; null and false skipped). */
export function append(el, ...children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

/** Replaces what `el` holds. */
export function fill(el, ...children) {
  el.replaceChildren();
  return append(el, ...children);
}

// ------------------------------------------------------------- formatting

const NUMBER = new Intl.NumberFormat('en');

export function num(value) {
  return typeof value === 'number' ? NUMBER.format(value) : '–';
}

export function bytes(value) {
  if (typeof value !== 'number') return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let n = value;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${i === 0 ? n : n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
}

export function rate(value) {
  return typeof value === 'number' ? `${value.toFixed(value < 10 ? 1 : 0)}/s` : '–';
}

export function time(ms) {
  return new Date(ms).toLocaleTimeString('en-GB', { hour12: false });
}

/** A value of a dotted path ('message_stats.publish_details.rate'). */
export function pick(object, path) {
  return path.split('.').reduce((o, key) => (o == null ? undefined : o[key]), object);
}

// ----------------------------------------------------------------- pieces

/** A small coloured label. */
export function pill(text, kind = '') {
  return h('span', { class: `pill ${kind}` }, text);
}

/** Figures as a row of cards: [[label, value, kind?], ...]. */
export function cards(items) {
  return h('div', { class: 'cards' },
    items.map(([label, value, kind]) => h('div', { class: `card ${kind || ''}` },
      h('div', { class: 'card-value' }, value),
      h('div', { class: 'card-label' }, label))));
}

/** A two-column table of [label, value] pairs. */
export function facts(pairs) {
  return h('table', { class: 'facts' },
    h('tbody', {}, pairs.map(([label, value]) => h('tr', {}, h('th', {}, label), h('td', {}, value)))));
}

/**
 * A table. `columns`: [{label, render(row) -> node or text, sort: 'field', num: bool}].
 * With `sorting` ({key, reverse, onSort(key)}), headers with a `sort` field are buttons.
 */
export function table(columns, rows, { sorting, empty = 'Nothing here.', rowKey } = {}) {
  const head = h('tr', {}, columns.map((column) => {
    const cls = column.num ? 'num' : '';
    if (!sorting || !column.sort) return h('th', { class: cls }, column.label);
    const active = sorting.key === column.sort;
    const arrow = active ? (sorting.reverse ? ' ▼' : ' ▲') : '';
    return h('th', { class: cls, 'aria-sort': active ? (sorting.reverse ? 'descending' : 'ascending') : null },
      h('button', { class: 'sort', type: 'button', 'data-sort': column.sort, onclick: () => sorting.onSort(column.sort) },
        column.label + arrow));
  }));
  const body = rows.length === 0
    ? [h('tr', {}, h('td', { class: 'empty', colspan: columns.length }, empty))]
    : rows.map((row) => h('tr', rowKey ? { 'data-key': rowKey(row) } : {},
      columns.map((column) => h('td', { class: column.num ? 'num' : '' }, column.render(row)))));
  return h('table', { class: 'list' }, h('thead', {}, head), h('tbody', {}, body));
}

/** A labelled form field. */
export function field(label, input, hint) {
  return h('label', { class: 'field' }, h('span', {}, label), input, hint ? h('small', {}, hint) : null);
}

/** A checkbox with its label. */
export function checkbox(label, name, checked) {
  return h('label', { class: 'check' }, h('input', { type: 'checkbox', name, checked }), ' ', label);
}

/** A <select> of values ([value] or [[value, label]]). */
export function select(name, options, selected) {
  return h('select', { name }, options.map((option) => {
    const [value, label] = Array.isArray(option) ? option : [option, option];
    return h('option', { value, selected: value === selected }, label);
  }));
}

/** A form whose submit calls `onsubmit(values)`; values are read by name. */
export function form(cls, onsubmit, ...children) {
  const el = h('form', { class: `form ${cls}`, novalidate: true }, children);
  el.addEventListener('submit', (event) => {
    event.preventDefault();
    const values = {};
    for (const input of el.elements) {
      if (!input.name) continue;
      values[input.name] = input.type === 'checkbox' ? input.checked : input.value;
    }
    onsubmit(values, el);
  });
  return el;
}

/** A JSON object typed in a textarea ('' is {}); throws a readable error. */
export function jsonObject(text, what) {
  if (!text.trim()) return {};
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    throw new Error(`${what} is not JSON: ${error.message}`);
  }
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    throw new Error(`${what} must be a JSON object`);
  }
  return value;
}
