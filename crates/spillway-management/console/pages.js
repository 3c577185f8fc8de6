// The console's pages. Each takes the Page of app.js (its <section>, the
// user's abilities `can`, timers that stop when the user leaves) and draws
// from the /api/... endpoints. Lists are paged by the server (page,
// page_size, name, use_regex, sort, sort_reverse): the console never asks
// for every queue at once.

import { ApiError, del, get, path, post, put, query } from './api.js';
import {
  append, bytes, cards, checkbox, facts, field, fill, form, h, jsonObject, num, pick, pill, rate,
  select, table,
} from './dom.js';
import { Ring, budgetBar, lineChart } from './charts.js';

/** Samples kept per chart: 10 minutes at one every 5 s. */
const HISTORY = 120;
const DEFAULT_EXCHANGE = 'amq.default';
// RabbitMQ's get modes, as the API serves them: the requeue ones leave the
// messages where they are; the others take them (rejected ones are dead-lettered).
const ACK_MODES = [
  ['ack_requeue_true', 'Look: leave them in the queue'],
  ['reject_requeue_true', 'Look: reject, requeue'],
  ['ack_requeue_false', 'Take: acknowledge (removed)'],
  ['reject_requeue_false', 'Take: reject (dead-lettered or dropped)'],
];

const queueHref = (vhost, name) => `#/queues/${encodeURIComponent(vhost)}/${encodeURIComponent(name)}`;
const exchangeHref = (vhost, name) =>
  `#/exchanges/${encodeURIComponent(vhost)}/${encodeURIComponent(name || DEFAULT_EXCHANGE)}`;

function heading(title, ...rest) {
  return h('div', { class: 'page-head' }, h('h1', {}, title), rest);
}

function json(value) {
  return h('code', { class: 'json' }, JSON.stringify(value));
}

/** Arguments as `key = value` lines, or a dash. */
function argumentList(args) {
  const entries = Object.entries(args || {});
  if (entries.length === 0) return '–';
  return h('ul', { class: 'args' }, entries.map(([key, value]) => h('li', {}, h('code', {}, key), ' = ', JSON.stringify(value))));
}

async function vhostNames() {
  return (await get('/api/vhosts')).map((vhost) => vhost.name);
}

function button(label, onclick, cls = '', attrs = {}) {
  return h('button', { type: 'button', class: cls, onclick, ...attrs }, label);
}

/** A panel that opens: <details> needs no script. */
function panel(id, title, ...children) {
  return h('details', { class: 'panel', id }, h('summary', {}, title), h('div', { class: 'panel-body' }, children));
}

// ------------------------------------------------------------ paged lists

/**
 * A list the server pages, filters and sorts, with its controls.
 * `state` ({page, size, name, regex, sort, reverse, vhost}) outlives the
 * page, so the list is as the user left it when they come back.
 */
function pagedList(page, { id, base, perVhost, columns, state, noun, rowKey }) {
  const status = h('span', { class: 'muted', id: `${id}-status` });
  const holder = h('div', { class: 'table-wrap', id: `${id}-table` });
  const filter = h('input', { type: 'search', id: `${id}-filter`, placeholder: 'Filter by name', value: state.name });
  const regex = h('input', { type: 'checkbox', id: `${id}-regex`, checked: state.regex });
  const size = select('page_size', ['25', '50', '100', '500'], String(state.size));
  const vhosts = perVhost ? h('select', { id: `${id}-vhost` }, h('option', { value: '' }, 'All vhosts')) : null;
  const previous = button('‹ Previous', () => go(state.page - 1), 'small', { id: `${id}-previous` });
  const next = button('Next ›', () => go(state.page + 1), 'small', { id: `${id}-next` });
  let asked = 0;
  let typing = null;

  async function refresh() {
    const mine = ++asked;
    const url = (state.vhost ? `${base}/${encodeURIComponent(state.vhost)}` : base) + query({
      page: state.page,
      page_size: state.size,
      name: state.name,
      use_regex: state.regex && state.name ? 'true' : '',
      sort: state.sort,
      sort_reverse: state.reverse ? 'true' : '',
    });
    let answer;
    try {
      answer = await get(url);
    } catch (error) {
      // A page that no longer exists (fewer items now): back to the first.
      if (error instanceof ApiError && error.status === 400 && state.page > 1 && /range/i.test(error.message)) {
        state.page = 1;
        return refresh();
      }
      if (error instanceof ApiError && error.status === 400) {
        fill(status, h('span', { class: 'error-text' }, error.message));
        return undefined;
      }
      throw error;
    }
    if (mine !== asked) return undefined; // a newer answer is on its way
    const sorting = {
      key: state.sort,
      reverse: state.reverse,
      onSort: (key) => {
        state.reverse = state.sort === key ? !state.reverse : false;
        state.sort = key;
        state.page = 1;
        refresh().catch((error) => page.fail(error));
      },
    };
    fill(holder, table(columns, answer.items, { sorting, rowKey, empty: state.name ? `No ${noun} match.` : `No ${noun}.` }));
    const shown = answer.filtered_count === answer.total_count
      ? `${num(answer.total_count)} ${noun}`
      : `${num(answer.filtered_count)} of ${num(answer.total_count)} ${noun}`;
    fill(status, shown, ` · page ${num(answer.page)} of ${num(Math.max(answer.page_count, 1))}`);
    holder.dataset.total = String(answer.total_count);
    previous.disabled = answer.page <= 1;
    next.disabled = answer.page >= answer.page_count;
    return answer;
  }

  function go(number) {
    state.page = Math.max(1, number);
    refresh().catch((error) => page.fail(error));
  }

  filter.addEventListener('input', () => {
    clearTimeout(typing);
    typing = setTimeout(() => {
      state.name = filter.value;
      go(1);
    }, 250);
  });
  regex.addEventListener('change', () => {
    state.regex = regex.checked;
    go(1);
  });
  size.addEventListener('change', () => {
    state.size = Number(size.value);
    go(1);
  });
  if (vhosts) {
    vhostNames().then((names) => {
      append(vhosts, names.map((name) => h('option', { value: name, selected: name === state.vhost }, name)));
    }).catch(() => {});
    vhosts.addEventListener('change', () => {
      state.vhost = vhosts.value;
      go(1);
    });
  }
  const controls = h('div', { class: 'controls' },
    vhosts, filter, h('label', { class: 'check' }, regex, ' Regex'),
    h('span', { class: 'spacer' }), status, previous, next, h('label', { class: 'check' }, 'Per page ', size));
  return { el: h('div', { class: 'paged', id }, controls, holder), refresh };
}

const listState = (sort) => ({ page: 1, size: 50, name: '', regex: false, sort, reverse: false, vhost: '' });
const queuesState = listState('name');
const exchangesState = listState('name');
const connectionsState = listState('name');
const channelsState = listState('name');

// --------------------------------------------------------------- overview

/** The overview's samples: kept while the console is open, so a return shows the past minutes. */
const overviewHistory = new Ring(HISTORY);

export async function overview(page) {
  const node = h('span', { class: 'muted', id: 'overview-node' });
  const totals = h('div', { id: 'overview-totals' });
  const spill = h('div', { id: 'flow-to-disk' });
  const charts = h('div', { class: 'charts', id: 'overview-charts' });
  append(page.section, heading('Overview', node), totals,
    h('h2', {}, 'Memory budget and flow to disk'), spill, h('h2', {}, 'Over time'), charts);

  page.every(async () => {
    const o = await get('/api/overview');
    const ftd = o.flow_to_disk || {};
    const store = o.store || {};
    const queued = o.queue_totals || {};
    const objects = o.object_totals || {};
    overviewHistory.push({
      t: Date.now(),
      publish: pick(o, 'message_stats.publish_details.rate'),
      deliver: pick(o, 'message_stats.deliver_get_details.rate'),
      ready: queued.messages_ready,
      unacked: queued.messages_unacknowledged,
      resident: ftd.resident_message_bytes,
      spilled: ftd.spilled_bytes,
      threshold: ftd.threshold_bytes,
    });
    fill(node, `${o.product_name || 'Spillway'} ${o.product_version || ''} on ${o.node || ''}`);
    fill(totals, cards([
      ['Connections', num(objects.connections)],
      ['Channels', num(objects.channels)],
      ['Queues', num(objects.queues)],
      ['Consumers', num(objects.consumers)],
      ['Ready', num(queued.messages_ready)],
      ['Unacked', num(queued.messages_unacknowledged)],
      ['Publish', rate(pick(o, 'message_stats.publish_details.rate'))],
      ['Deliver / get', rate(pick(o, 'message_stats.deliver_get_details.rate'))],
    ]));

    const quota = typeof store.quota_bytes === 'number' && store.quota_bytes > 0 ? store.quota_bytes : 0;
    fill(spill,
      h('div', { class: 'status-line' },
        ftd.active
          ? pill('flow to disk active: payloads go to the store', 'warn')
          : pill('flow to disk inactive: payloads in memory', 'ok'),
        store.overfull ? pill('store quota reached: publishers blocked', 'bad') : null),
      h('div', { class: 'bars' },
        h('div', {}, h('h3', {}, 'Engine memory (message bytes)'),
          budgetBar({ parts: [{ label: 'resident', value: ftd.resident_message_bytes || 0 }], total: ftd.threshold_bytes || 0, format: bytes }),
          h('p', { class: 'muted' }, `${num(ftd.spilled_messages)} messages (${bytes(ftd.spilled_bytes)}) spilled to the store`)),
        h('div', {}, h('h3', {}, 'Store disk'),
          quota
            ? budgetBar({ parts: [{ label: 'on disk', value: store.disk_bytes || 0 }], total: quota, format: bytes })
            : h('div', { class: 'big' }, bytes(store.disk_bytes)),
          h('p', { class: 'muted' }, quota ? `disk quota ${bytes(quota)}` : 'on disk; no disk quota set'))));

    const samples = overviewHistory.items;
    fill(charts,
      lineChart({
        title: 'Message rates',
        samples,
        series: [{ key: 'publish', label: 'publish' }, { key: 'deliver', label: 'deliver / get' }],
        format: rate,
      }),
      lineChart({
        title: 'Queued messages',
        samples,
        series: [{ key: 'ready', label: 'ready' }, { key: 'unacked', label: 'unacked' }],
        format: num,
      }),
      lineChart({
        title: 'Flow to disk: message bytes',
        samples,
        series: [
          { key: 'resident', label: 'resident' },
          { key: 'spilled', label: 'spilled' },
          { key: 'threshold', label: 'budget', dashed: true },
        ],
        format: bytes,
        bytes: true,
      }));
  });
}

// ----------------------------------------------------------------- queues

function features(item) {
  return [
    item.durable ? pill('D', 'feature') : null,
    item.auto_delete ? pill('AD', 'feature') : null,
    item.exclusive ? pill('Excl', 'feature') : null,
    item.internal ? pill('I', 'feature') : null,
    Object.keys(item.arguments || {}).length ? pill('Args', 'feature') : null,
    item.policy ? pill(item.policy, 'policy') : null,
  ];
}

export async function queues(page) {
  const list = pagedList(page, {
    id: 'queues',
    base: '/api/queues',
    perVhost: true,
    state: queuesState,
    noun: 'queues',
    rowKey: (q) => `${q.vhost}/${q.name}`,
    columns: [
      { label: 'Name', sort: 'name', render: (q) => h('a', { href: queueHref(q.vhost, q.name), class: 'name' }, q.name) },
      { label: 'Vhost', sort: 'vhost', render: (q) => q.vhost },
      { label: 'Features', render: features },
      { label: 'State', sort: 'state', render: (q) => [q.state, q.overfull ? pill('overfull', 'bad') : null] },
      { label: 'Ready', sort: 'messages_ready', num: true, render: (q) => num(q.messages_ready) },
      { label: 'Unacked', sort: 'messages_unacknowledged', num: true, render: (q) => num(q.messages_unacknowledged) },
      { label: 'Total', sort: 'messages', num: true, render: (q) => num(q.messages) },
      { label: 'Consumers', sort: 'consumers', num: true, render: (q) => num(q.consumers) },
      { label: 'In memory', sort: 'resident_bytes', num: true, render: (q) => bytes(q.resident_bytes) },
      { label: 'Spilled', sort: 'spilled_bytes', num: true, render: (q) => bytes(q.spilled_bytes) },
      { label: 'In', sort: 'message_stats.publish_details.rate', num: true, render: (q) => rate(pick(q, 'message_stats.publish_details.rate')) },
      { label: 'Out', sort: 'message_stats.deliver_get_details.rate', num: true, render: (q) => rate(pick(q, 'message_stats.deliver_get_details.rate')) },
    ],
  });
  append(page.section, heading('Queues'), list.el);
  page.every(list.refresh);
  if (page.can.write) append(page.section, await addQueueForm(page, list));
}

async function addQueueForm(page, list) {
  const vhosts = await vhostNames();
  return panel('add-queue', 'Add a queue', form('add-queue', async (v) => {
    let args;
    try {
      args = jsonObject(v.arguments, 'Arguments');
    } catch (error) {
      page.flash(error.message, 'error');
      return;
    }
    if (!v.name.trim()) {
      page.flash('A queue needs a name.', 'error');
      return;
    }
    await page.act(() => put(path`/api/queues/${v.vhost}/${v.name}`,
      { durable: v.durable, auto_delete: v.auto_delete, arguments: args }), `Queue '${v.name}' declared.`);
    await list.refresh();
  },
  field('Vhost', select('vhost', vhosts, vhosts.includes('/') ? '/' : vhosts[0])),
  field('Name', h('input', { name: 'name', id: 'add-queue-name', required: true })),
  h('div', { class: 'checks' }, checkbox('Durable', 'durable', true), checkbox('Auto-delete', 'auto_delete', false)),
  field('Arguments (JSON)', h('textarea', { name: 'arguments', id: 'add-queue-arguments', rows: 3, placeholder: '{"x-max-length": 10000}' })),
  h('button', { type: 'submit', id: 'add-queue-submit' }, 'Add queue')));
}

// ------------------------------------------------------------ one queue

export async function queue(page) {
  const { vhost, name } = page.params;
  const url = path`/api/queues/${vhost}/${name}`;
  const depth = new Ring(HISTORY);
  const figures = h('div', { id: 'queue-figures' });
  const chart = h('div', { id: 'queue-chart' });
  const details = h('div', { id: 'queue-details' });
  const bindings = h('div', { id: 'queue-bindings' });
  const messages = h('div', { id: 'queue-messages' });
  let policyShown = null;
  const policyBox = h('div', { id: 'queue-policy' });

  append(page.section,
    heading(`Queue ${name}`, h('span', { class: 'muted' }, `in vhost ${vhost}`), h('a', { href: '#/queues', class: 'back' }, '← all queues')),
    figures,
    h('div', { class: 'columns' },
      h('div', {}, chart, h('h2', {}, 'Details'), details),
      h('div', {}, h('h2', { class: 'first' }, 'Policy'), policyBox, h('h2', {}, 'Bindings'), bindings)));

  async function showPolicy(q) {
    const names = [q.policy, q.operator_policy].filter(Boolean).join(' + ');
    if (names === policyShown) return;
    policyShown = names;
    if (!q.policy && !q.operator_policy) {
      fill(policyBox, h('p', { class: 'muted' }, 'No policy applies.'));
      return;
    }
    const rows = [];
    if (q.policy) rows.push(['Policy', h('a', { href: '#/policies' }, q.policy)]);
    if (q.operator_policy) rows.push(['Operator policy', q.operator_policy]);
    if (q.effective_policy_definition) rows.push(['Effective definition', json(q.effective_policy_definition)]);
    else if (q.policy) {
      try {
        const policy = await get(path`/api/policies/${vhost}/${q.policy}`);
        rows.push(['Definition', json(policy.definition)], ['Pattern', h('code', {}, policy.pattern)]);
      } catch {
        // Not the user's to read: the name is enough.
      }
    }
    rows.push(['Effective arguments', argumentList(q.effective_arguments)]);
    fill(policyBox, facts(rows));
  }

  async function refreshBindings() {
    const list = await get(`${url}/bindings`);
    fill(bindings, table([
      { label: 'From exchange', render: (b) => h('a', { href: exchangeHref(vhost, b.source) }, b.source || '(AMQP default)') },
      { label: 'Routing key', render: (b) => h('code', {}, b.routing_key) },
      { label: 'Arguments', render: (b) => argumentList(b.arguments) },
    ], list, { empty: 'No bindings.' }));
  }

  async function refresh() {
    let q;
    try {
      q = await get(url);
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) {
        page.leave();
        fill(page.section, heading(`Queue ${name}`), h('p', {}, `There is no queue '${name}' in vhost '${vhost}' (any more).`),
          h('a', { href: '#/queues' }, '← all queues'));
        return;
      }
      throw error;
    }
    depth.push({ t: Date.now(), ready: q.messages_ready, unacked: q.messages_unacknowledged, spilled: q.spilled_messages });
    fill(figures, cards([
      ['Ready', h('span', { id: 'queue-ready' }, num(q.messages_ready))],
      ['Unacked', num(q.messages_unacknowledged)],
      ['Total', h('span', { id: 'queue-total' }, num(q.messages))],
      ['Consumers', num(q.consumers)],
      ['Bytes', bytes(q.message_bytes)],
      ['In memory', bytes(q.resident_bytes)],
      ['Spilled', `${num(q.spilled_messages)} · ${bytes(q.spilled_bytes)}`, q.spilled_messages ? 'warn' : ''],
      ['In / out', `${rate(pick(q, 'message_stats.publish_details.rate'))} · ${rate(pick(q, 'message_stats.deliver_get_details.rate'))}`],
    ]));
    fill(chart, lineChart({
      title: 'Depth',
      samples: depth.items,
      series: [{ key: 'ready', label: 'ready' }, { key: 'unacked', label: 'unacked' }, { key: 'spilled', label: 'spilled' }],
      format: num,
    }));
    fill(details, facts([
      ['State', [q.state, q.overfull ? pill('overfull: publishers held', 'bad') : null]],
      ['Features', features(q)],
      ['Arguments', argumentList(q.arguments)],
      ['Consumers', num(q.consumers)],
      ['Single active consumer', q.single_active_consumer_tag || '–'],
      ['Idle since', q.idle_since || '–'],
      ['Node', q.node],
    ]));
    await showPolicy(q);
  }

  if (page.can.write) {
    append(page.section, h('h2', {}, 'Actions'), h('div', { class: 'actions' },
      publishPanel(page, vhost, DEFAULT_EXCHANGE, name, refresh),
      panel('get-messages', 'Get messages', form('get', async (v) => {
        const got = await page.act(() => post(`${url}/get`, {
          count: Number(v.count) || 1, ackmode: v.ackmode, encoding: 'auto', truncate: 50000,
        }));
        if (got) showMessages(messages, got);
        if (got && v.ackmode.endsWith('_false')) await refresh();
      },
      field('Messages', h('input', { name: 'count', type: 'number', min: 1, max: 1000, value: '1', id: 'get-count' })),
      field('Mode', select('ackmode', ACK_MODES, ACK_MODES[0][0])),
      h('button', { type: 'submit', id: 'get-submit' }, 'Get messages')), messages),
      panel('move-messages', 'Move messages', form('move', async (v) => {
        if (!v.destination.trim()) {
          page.flash('Name the queue to move the messages to.', 'error');
          return;
        }
        const body = { destination: v.destination };
        if (v.count) body.count = Number(v.count);
        await page.act(() => post(`${url}/move`, body),
          (a) => `Moved ${num(a.moved)} ${a.moved === 1 ? 'message' : 'messages'} to '${v.destination}'; ${num(a.remaining)} left${a.stopped_reason ? ` (stopped: ${a.stopped_reason})` : ''}.`);
        await refresh();
      },
      field('To queue (same vhost)', h('input', { name: 'destination', id: 'move-destination' })),
      field('At most', h('input', { name: 'count', type: 'number', min: 0, placeholder: 'all', id: 'move-count' })),
      h('button', { type: 'submit', id: 'move-submit' }, 'Move messages'))),
      h('div', { class: 'danger-zone' },
        button('Purge', async () => {
          // eslint-disable-next-line no-alert
          if (!window.confirm(`Purge every ready message of queue '${name}'?`)) return;
          await page.act(() => del(`${url}/contents`), `Queue '${name}' purged.`);
          await refresh();
        }, 'danger', { id: 'purge' }),
        button('Delete queue', async () => {
          // eslint-disable-next-line no-alert
          if (!window.confirm(`Delete queue '${name}' and its messages?`)) return;
          const done = await page.act(() => del(url), `Queue '${name}' deleted.`);
          if (done !== undefined) location.hash = '#/queues';
        }, 'danger', { id: 'delete-queue' }))));
  }

  refreshBindings().catch((error) => page.fail(error));
  page.every(refresh);
}

function showMessages(box, got) {
  if (got.length === 0) {
    fill(box, h('p', { class: 'muted' }, 'The queue is empty.'));
    return;
  }
  fill(box, got.map((m, i) => h('div', { class: 'message' },
    h('div', { class: 'message-head' }, `Message ${i + 1}`, ' · ',
      `exchange '${m.exchange || '(AMQP default)'}', routing key '${m.routing_key}'`, ' · ',
      `${num(m.payload_bytes)} bytes`, m.redelivered ? pill('redelivered', 'warn') : null,
      m.payload_encoding === 'base64' ? pill('base64', 'feature') : null),
    facts([['Properties', json(m.properties)]]),
    h('pre', { class: 'payload' }, m.payload))));
}

/** Publishing to an exchange (the default one with the queue's name as key, from a queue's page). */
function publishPanel(page, vhost, exchange, fixedKey, after) {
  return panel('publish', 'Publish a message', form('publish', async (v) => {
    let properties;
    try {
      properties = jsonObject(v.properties, 'Properties');
    } catch (error) {
      page.flash(error.message, 'error');
      return;
    }
    if (v.persistent) properties.delivery_mode = 2;
    const body = { routing_key: fixedKey ?? v.routing_key, payload: v.payload, payload_encoding: 'string', properties };
    await page.act(() => post(path`/api/exchanges/${vhost}/${exchange}/publish`, body),
      (a) => (a && a.routed ? 'Message published.' : 'Message published, but no queue took it (not routed).'));
    if (after) await after();
  },
  fixedKey === null
    ? field('Routing key', h('input', { name: 'routing_key', id: 'publish-routing-key' }))
    : h('p', { class: 'muted' }, `To this queue, through the default exchange (routing key '${fixedKey}').`),
  field('Payload', h('textarea', { name: 'payload', id: 'publish-payload', rows: 4 })),
  checkbox('Persistent (delivery mode 2)', 'persistent', false),
  field('Properties (JSON)', h('textarea', { name: 'properties', rows: 2, placeholder: '{"content_type": "text/plain", "headers": {"k": "v"}}' })),
  h('button', { type: 'submit', id: 'publish-submit' }, 'Publish')));
}

// -------------------------------------------------------------- exchanges

export async function exchanges(page) {
  const columns = [
    { label: 'Name', sort: 'name', render: (x) => h('a', { href: exchangeHref(x.vhost, x.name), class: 'name' }, x.name || '(AMQP default)') },
    { label: 'Vhost', sort: 'vhost', render: (x) => x.vhost },
    { label: 'Type', sort: 'type', render: (x) => x.type },
    { label: 'Features', render: features },
  ];
  let list = null;
  if (page.can.write) {
    columns.push({
      label: '',
      render: (x) => (deletable(x.name) ? button('Delete', async () => {
        // eslint-disable-next-line no-alert
        if (!window.confirm(`Delete exchange '${x.name}'?`)) return;
        await page.act(() => del(path`/api/exchanges/${x.vhost}/${x.name}`), `Exchange '${x.name}' deleted.`);
        await list.refresh();
      }, 'small danger') : ''),
    });
  }
  list = pagedList(page, {
    id: 'exchanges', base: '/api/exchanges', perVhost: true, state: exchangesState, noun: 'exchanges', columns,
  });
  append(page.section, heading('Exchanges'), list.el);
  page.every(list.refresh);
  if (page.can.write) {
    const vhosts = await vhostNames();
    append(page.section, panel('add-exchange', 'Add an exchange', form('add-exchange', async (v) => {
      let args;
      try {
        args = jsonObject(v.arguments, 'Arguments');
      } catch (error) {
        page.flash(error.message, 'error');
        return;
      }
      await page.act(() => put(path`/api/exchanges/${v.vhost}/${v.name}`, {
        type: v.type, durable: v.durable, auto_delete: v.auto_delete, internal: v.internal, arguments: args,
      }), `Exchange '${v.name}' declared.`);
      await list.refresh();
    },
    field('Vhost', select('vhost', vhosts, vhosts.includes('/') ? '/' : vhosts[0])),
    field('Name', h('input', { name: 'name', id: 'add-exchange-name' })),
    field('Type', select('type', ['direct', 'fanout', 'topic', 'headers', 'x-delayed-message'], 'direct')),
    h('div', { class: 'checks' }, checkbox('Durable', 'durable', true), checkbox('Auto-delete', 'auto_delete', false),
      checkbox('Internal', 'internal', false)),
    field('Arguments (JSON)', h('textarea', { name: 'arguments', rows: 2, placeholder: '{"alternate-exchange": "unrouted"}' })),
    h('button', { type: 'submit', id: 'add-exchange-submit' }, 'Add exchange'))));
  }
}

const deletable = (name) => name !== '' && !name.startsWith('amq.');

export async function exchange(page) {
  const { vhost, name } = page.params;
  const shown = name === DEFAULT_EXCHANGE ? '(AMQP default)' : name;
  const url = path`/api/exchanges/${vhost}/${name}`;
  const x = await get(url);
  const bindings = h('div', { id: 'exchange-bindings' });
  append(page.section,
    heading(`Exchange ${shown}`, h('span', { class: 'muted' }, `in vhost ${vhost}`), h('a', { href: '#/exchanges', class: 'back' }, '← all exchanges')),
    h('div', { class: 'columns' },
      h('div', {}, h('h2', {}, 'Details'), facts([
        ['Type', x.type],
        ['Features', features(x)],
        ['Arguments', argumentList(x.arguments)],
        ['Policy', x.policy || '–'],
        x.type === 'x-delayed-message' ? ['Delayed messages', num(x.delayed_messages)] : null,
      ].filter(Boolean))),
      h('div', {}, h('h2', {}, 'Bindings from here'), bindings)));

  async function refreshBindings() {
    const list = name === DEFAULT_EXCHANGE ? [] : await get(`${url}/bindings/source`);
    fill(bindings, table([
      { label: 'To', render: (b) => (b.destination_type === 'queue' ? h('a', { href: queueHref(vhost, b.destination) }, b.destination) : b.destination) },
      { label: 'Kind', render: (b) => b.destination_type },
      { label: 'Routing key', render: (b) => h('code', {}, b.routing_key) },
      { label: 'Arguments', render: (b) => argumentList(b.arguments) },
    ], list, { empty: name === DEFAULT_EXCHANGE ? 'Every queue, by its name.' : 'No bindings.' }));
  }
  await refreshBindings();

  if (page.can.write) {
    const actions = h('div', { class: 'actions' }, publishPanel(page, vhost, name, null, null));
    if (name !== DEFAULT_EXCHANGE) {
      append(actions, panel('bind', 'Bind a queue', form('bind', async (v) => {
        await page.act(() => post(path`/api/bindings/${vhost}/e/${name}/q/${v.queue}`, { routing_key: v.routing_key }),
          `Queue '${v.queue}' bound.`);
        await refreshBindings();
      },
      field('Queue', h('input', { name: 'queue', id: 'bind-queue' })),
      field('Routing key', h('input', { name: 'routing_key', id: 'bind-routing-key' })),
      h('button', { type: 'submit' }, 'Bind'))));
    }
    if (deletable(name)) {
      append(actions, h('div', { class: 'danger-zone' }, button('Delete exchange', async () => {
        // eslint-disable-next-line no-alert
        if (!window.confirm(`Delete exchange '${name}'?`)) return;
        const done = await page.act(() => del(url), `Exchange '${name}' deleted.`);
        if (done !== undefined) location.hash = '#/exchanges';
      }, 'danger', { id: 'delete-exchange' })));
    }
    append(page.section, h('h2', {}, 'Actions'), actions);
  }
}

// ------------------------------------------------- connections, channels

export async function connections(page) {
  const columns = [
    { label: 'Name', sort: 'name', render: (c) => [h('span', { class: 'name' }, c.name),
      c.client_properties && c.client_properties.connection_name
        ? h('div', { class: 'muted' }, c.client_properties.connection_name) : null] },
    { label: 'User', sort: 'user', render: (c) => c.user },
    { label: 'Vhost', sort: 'vhost', render: (c) => c.vhost },
    { label: 'Protocol', render: (c) => c.protocol },
    { label: 'Channels', sort: 'channels', num: true, render: (c) => num(c.channels) },
    { label: 'Published', sort: 'messages_published', num: true, render: (c) => num(c.messages_published) },
    { label: 'Delivered', sort: 'messages_delivered', num: true, render: (c) => num(c.messages_delivered) },
  ];
  let list = null;
  if (page.can.write) {
    columns.push({
      label: '',
      render: (c) => button('Close', async () => {
        // eslint-disable-next-line no-alert
        if (!window.confirm(`Close connection '${c.name}'?`)) return;
        await page.act(() => del(path`/api/connections/${c.name}`, { 'x-reason': `Closed from the web console by ${page.me.name}` }),
          'Connection closed.');
        await list.refresh();
      }, 'small danger close-connection'),
    });
  }
  list = pagedList(page, {
    id: 'connections', base: '/api/connections', state: connectionsState, noun: 'connections', columns,
    rowKey: (c) => (c.client_properties && c.client_properties.connection_name) || c.name,
  });
  const channels = pagedList(page, {
    id: 'channels',
    base: '/api/channels',
    state: channelsState,
    noun: 'channels',
    columns: [
      { label: 'Channel', sort: 'name', render: (c) => c.name },
      { label: 'User', sort: 'user', render: (c) => c.user },
      { label: 'Vhost', sort: 'vhost', render: (c) => c.vhost },
      { label: 'State', sort: 'state', render: (c) => (c.state === 'flow' ? pill(`blocked${c.blocked_reason ? `: ${c.blocked_reason}` : ''}`, 'bad') : c.state) },
      { label: 'Confirm', render: (c) => (c.confirm ? '✓' : '') },
      { label: 'Prefetch', sort: 'prefetch_count', num: true, render: (c) => num(c.prefetch_count) },
      { label: 'Consumers', sort: 'consumer_count', num: true, render: (c) => num(c.consumer_count) },
      { label: 'Unacked', sort: 'messages_unacknowledged', num: true, render: (c) => num(c.messages_unacknowledged) },
    ],
  });
  append(page.section, heading('Connections'), list.el, h('h2', {}, 'Channels'), channels.el);
  page.every(() => Promise.all([list.refresh(), channels.refresh()]));
}

// ---------------------------------------------------- users, permissions

const TAGS = ['administrator', 'monitoring', 'policymaker', 'management'];

export async function users(page) {
  const usersBox = h('div', { id: 'users' });
  const vhostsBox = h('div', { id: 'vhosts' });
  const permissionsBox = h('div', { id: 'permissions' });
  const forms = h('div', { class: 'actions' });
  append(page.section, heading('Users and permissions'), usersBox,
    h('div', { class: 'columns' }, h('div', {}, h('h2', {}, 'Permissions'), permissionsBox), h('div', {}, h('h2', {}, 'Vhosts'), vhostsBox)),
    forms);

  async function refresh() {
    const [userList, vhostList, permissionList] = await Promise.all([
      get('/api/users'), get('/api/vhosts'), get('/api/permissions')]);
    fill(usersBox, table([
      { label: 'Name', render: (u) => h('span', { class: 'name' }, u.name) },
      { label: 'Tags', render: (u) => (u.tags.length ? u.tags.map((tag) => pill(tag, 'feature')) : h('span', { class: 'muted' }, 'none: no console')) },
      { label: '', render: (u) => (u.name === page.me.name ? h('span', { class: 'muted' }, 'you') : button('Delete', async () => {
        // eslint-disable-next-line no-alert
        if (!window.confirm(`Delete user '${u.name}'? Its connections are closed.`)) return;
        await page.act(() => del(path`/api/users/${u.name}`), `User '${u.name}' deleted.`);
        await refresh();
      }, 'small danger')) },
    ], userList, { rowKey: (u) => u.name }));
    fill(permissionsBox, table([
      { label: 'User', render: (p) => p.user },
      { label: 'Vhost', render: (p) => p.vhost },
      { label: 'Configure', render: (p) => h('code', {}, p.configure) },
      { label: 'Write', render: (p) => h('code', {}, p.write) },
      { label: 'Read', render: (p) => h('code', {}, p.read) },
      { label: '', render: (p) => button('Clear', async () => {
        await page.act(() => del(path`/api/permissions/${p.vhost}/${p.user}`), `Permissions of '${p.user}' in '${p.vhost}' cleared.`);
        await refresh();
      }, 'small danger') },
    ], permissionList, { empty: 'No permissions.' }));
    fill(vhostsBox, table([
      { label: 'Name', render: (v) => v.name },
      { label: 'Messages', num: true, render: (v) => num(v.messages) },
      { label: '', render: (v) => button('Delete', async () => {
        // eslint-disable-next-line no-alert
        if (!window.confirm(`Delete vhost '${v.name}' and everything in it?`)) return;
        await page.act(() => del(path`/api/vhosts/${v.name}`), `Vhost '${v.name}' deleted.`);
        await refresh();
      }, 'small danger') },
    ], vhostList));
    fill(forms,
      panel('add-user', 'Add a user', form('add-user', async (v) => {
        const tags = TAGS.filter((tag) => v[`tag-${tag}`]);
        await page.act(() => put(path`/api/users/${v.name}`, { password: v.password, tags }), `User '${v.name}' stored.`);
        await refresh();
      },
      field('Name', h('input', { name: 'name', id: 'add-user-name', autocomplete: 'off' })),
      field('Password', h('input', { name: 'password', type: 'password', id: 'add-user-password', autocomplete: 'new-password' })),
      h('div', { class: 'checks' }, TAGS.map((tag) => checkbox(tag, `tag-${tag}`, false))),
      h('button', { type: 'submit', id: 'add-user-submit' }, 'Add user'))),
      panel('set-permissions', 'Set permissions', form('set-permissions', async (v) => {
        await page.act(() => put(path`/api/permissions/${v.vhost}/${v.user}`,
          { configure: v.configure, write: v.write, read: v.read }), `Permissions of '${v.user}' in '${v.vhost}' set.`);
        await refresh();
      },
      field('User', select('user', userList.map((u) => u.name))),
      field('Vhost', select('vhost', vhostList.map((v) => v.name), '/')),
      field('Configure', h('input', { name: 'configure', value: '.*' })),
      field('Write', h('input', { name: 'write', value: '.*' })),
      field('Read', h('input', { name: 'read', value: '.*' })),
      h('button', { type: 'submit' }, 'Set permissions'))),
      panel('add-vhost', 'Add a vhost', form('add-vhost', async (v) => {
        await page.act(() => put(path`/api/vhosts/${v.name}`), `Vhost '${v.name}' created.`);
        await refresh();
      },
      field('Name', h('input', { name: 'name' })),
      h('button', { type: 'submit' }, 'Add vhost'))));
  }
  await refresh();
}

// --------------------------------------------------------------- policies

export async function policies(page) {
  const box = h('div', { id: 'policies' });
  append(page.section, heading('Policies'), box);
  const columns = [
    { label: 'Vhost', render: (p) => p.vhost },
    { label: 'Name', render: (p) => h('span', { class: 'name' }, p.name) },
    { label: 'Pattern', render: (p) => h('code', {}, p.pattern) },
    { label: 'Applies to', render: (p) => p['apply-to'] },
    { label: 'Priority', num: true, render: (p) => num(p.priority) },
    { label: 'Definition', render: (p) => json(p.definition) },
  ];
  if (page.can.policies) {
    columns.push({
      label: '',
      render: (p) => button('Clear', async () => {
        // eslint-disable-next-line no-alert
        if (!window.confirm(`Clear policy '${p.name}'?`)) return;
        await page.act(() => del(path`/api/policies/${p.vhost}/${p.name}`), `Policy '${p.name}' cleared.`);
        await refresh();
      }, 'small danger'),
    });
  }
  async function refresh() {
    fill(box, table(columns, await get('/api/policies'), { empty: 'No policies.' }));
  }
  await refresh();
  if (page.can.policies) {
    const vhosts = await vhostNames();
    append(page.section, panel('set-policy', 'Set a policy', form('set-policy', async (v) => {
      let definition;
      try {
        definition = jsonObject(v.definition, 'Definition');
      } catch (error) {
        page.flash(error.message, 'error');
        return;
      }
      await page.act(() => put(path`/api/policies/${v.vhost}/${v.name}`, {
        pattern: v.pattern, definition, priority: Number(v.priority) || 0, 'apply-to': v.apply_to,
      }), `Policy '${v.name}' set.`);
      await refresh();
    },
    field('Vhost', select('vhost', vhosts, '/')),
    field('Name', h('input', { name: 'name', id: 'set-policy-name' })),
    field('Pattern (regular expression)', h('input', { name: 'pattern', placeholder: '^orders\\.' })),
    field('Applies to', select('apply_to', ['queues', 'exchanges', 'all'], 'queues')),
    field('Priority', h('input', { name: 'priority', type: 'number', value: '0' })),
    field('Definition (JSON)', h('textarea', { name: 'definition', rows: 3, placeholder: '{"max-length": 10000}' })),
    h('button', { type: 'submit', id: 'set-policy-submit' }, 'Set policy'))));
  }
}
