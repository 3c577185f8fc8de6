// The console's shell: login, the navigation the user's tags allow, and
// hash routing (#/overview, #/queues, #/queues/VHOST/NAME, ...). Each page
// lives in pages.js and draws into a fresh <section>; what it polls stops
// when the user goes elsewhere.

import { ApiError, api, forgetLogin, get, saveLogin, savedLogin } from './api.js';
import { fill, form, field, h } from './dom.js';
import * as pages from './pages.js';

const main = document.getElementById('main');
const nav = document.getElementById('nav');
const who = document.getElementById('who');
const flashBox = document.getElementById('flash');
let flashTimer = null;

/** A message over the page: 'ok' ones go after a while, errors stay until the next. */
function flash(text, kind = 'ok') {
  clearTimeout(flashTimer);
  flashBox.className = `notice ${kind}`;
  flashBox.setAttribute('role', kind === 'error' ? 'alert' : 'status');
  fill(flashBox, h('span', {}, text), h('button', { type: 'button', class: 'link', onclick: hideFlash }, '×'));
  flashBox.hidden = false;
  if (kind === 'ok') flashTimer = setTimeout(hideFlash, 8000);
}

function hideFlash() {
  flashBox.hidden = true;
}

/** What the console offers, by RabbitMQ's user tags (GET /api/whoami). */
export function abilities(tags) {
  const has = (tag) => tags.includes(tag);
  const admin = has('administrator');
  const policies = admin || has('policymaker');
  // monitoring alone sees everything and changes nothing in the console.
  const write = policies || has('management');
  return { admin, policies, write, login: write || has('monitoring') };
}

// Routes: a pattern of hash segments (':x' captures one, percent-decoded).
const ROUTES = [
  ['overview', pages.overview, 'Overview'],
  ['queues', pages.queues, 'Queues'],
  ['queues/:vhost/:name', pages.queue],
  ['exchanges', pages.exchanges, 'Exchanges'],
  ['exchanges/:vhost/:name', pages.exchange],
  ['connections', pages.connections, 'Connections'],
  ['users', pages.users, 'Users', (can) => can.admin],
  // Reading policies is the policymaker's, as in RabbitMQ.
  ['policies', pages.policies, 'Policies', (can) => can.policies],
];

// How often pages poll: the user's choice (header), 5 s unless changed.
const REFRESH_KEY = 'spillway.console.refresh';
const REFRESH_CHOICES = [2, 5, 10, 30];

function refreshMs() {
  const seconds = Number(sessionStorage.getItem(REFRESH_KEY));
  return (REFRESH_CHOICES.includes(seconds) ? seconds : 5) * 1000;
}

let me = null; // {name, tags, can}
let current = null; // the page being shown: its timers stop when it goes

function match(hash) {
  const parts = hash.replace(/^#\/?/, '').split('/').filter((p) => p !== '');
  for (const [pattern, render, , allowed] of ROUTES) {
    const want = pattern.split('/');
    if (want.length !== parts.length) continue;
    const params = {};
    const fits = want.every((segment, i) => {
      if (segment.startsWith(':')) {
        try {
          params[segment.slice(1)] = decodeURIComponent(parts[i]);
        } catch {
          return false;
        }
        return true;
      }
      return segment === parts[i];
    });
    if (fits && (!allowed || allowed(me.can))) return { render, params, name: want[0] };
  }
  return null;
}

/** What a page gets: where to draw, who is looking, and timers that stop with it. */
class Page {
  constructor(section, params) {
    this.section = section;
    this.params = params;
    this.me = me;
    this.can = me.can;
    this.gone = false;
    this.timers = new Set();
  }

  /** Calls `fn` now, and again each time the refresh interval passed after the previous call finished. */
  every(fn) {
    const tick = async () => {
      if (this.gone) return;
      try {
        await fn();
      } catch (error) {
        this.fail(error);
      }
      if (!this.gone) this.timers.add(setTimeout(tick, refreshMs()));
    };
    tick();
  }

  leave() {
    this.gone = true;
    for (const timer of this.timers) clearTimeout(timer);
  }

  /** Shows a message over the page ('ok' or 'error'). */
  flash(text, kind = 'ok') {
    if (!this.gone) flash(text, kind);
  }

  /** An error of an action or a poll: a lost login goes back to the login form. */
  async fail(error) {
    if (this.gone) return;
    if (error instanceof ApiError && error.status === 401) {
      // 401 is also "not allowed to touch this": only a failed login logs out.
      try {
        await get('/api/whoami');
      } catch (again) {
        if (again instanceof ApiError && again.status === 401) {
          showLogin(`Logged out: ${again.message}`);
          return;
        }
      }
      this.flash(`Not authorised: ${error.message}`, 'error');
      return;
    }
    this.flash(error.message || String(error), 'error');
  }

  /** Runs an action, then flashes `done` (a text or a function of its answer). */
  async act(action, done) {
    try {
      const answer = await action();
      if (!this.gone && done) this.flash(typeof done === 'function' ? done(answer) : done);
      return answer;
    } catch (error) {
      await this.fail(error);
      return undefined;
    }
  }
}

function route() {
  if (!me) return;
  if (current) current.leave();
  hideFlash();
  const found = match(location.hash);
  if (!found) {
    location.replace('#/overview');
    return;
  }
  for (const link of nav.querySelectorAll('a')) {
    link.classList.toggle('active', link.dataset.page === found.name);
  }
  const section = h('section', { class: `page page-${found.name}` });
  fill(main, section);
  current = new Page(section, found.params);
  const page = current;
  Promise.resolve(found.render(page)).catch((error) => page.fail(error));
}

function showNav() {
  fill(nav, ROUTES.filter(([, , label, allowed]) => label && (!allowed || allowed(me.can)))
    .map(([pattern, , label]) => h('a', { href: `#/${pattern}`, 'data-page': pattern }, label)));
  const refresh = h('select', { id: 'refresh', title: 'How often pages refresh their figures' },
    REFRESH_CHOICES.map((s) => h('option', { value: s, selected: s * 1000 === refreshMs() }, `every ${s} s`)));
  refresh.addEventListener('change', () => {
    sessionStorage.setItem(REFRESH_KEY, refresh.value);
    route();
  });
  fill(who,
    h('label', { class: 'refresh' }, 'Refresh ', refresh),
    h('span', { class: 'who-name', title: me.tags.join(', ') || 'no tags' }, me.name),
    h('span', { class: 'who-tags' }, me.tags.join(', ')),
    h('button', { type: 'button', class: 'link', id: 'logout', onclick: () => showLogin('Logged out.') }, 'Log out'));
}

function showLogin(message) {
  if (current) current.leave();
  hideFlash();
  current = null;
  me = null;
  forgetLogin();
  fill(nav);
  fill(who);
  const error = h('p', { class: 'notice error', id: 'login-error', role: 'alert', hidden: !message }, message || '');
  if (message === 'Logged out.') error.className = 'notice ok';
  const login = form('login', async (values) => {
    error.hidden = true;
    const ok = await logIn(values.user, values.password, (text) => {
      error.className = 'notice error';
      fill(error, text);
      error.hidden = false;
    });
    if (ok) route();
  },
  h('h1', {}, 'Spillway'),
  h('p', { class: 'muted' }, 'Log in with a user stored in the broker.'),
  field('User name', h('input', { name: 'user', id: 'login-user', autocomplete: 'username', required: true })),
  field('Password', h('input', { name: 'password', id: 'login-password', type: 'password', autocomplete: 'current-password' })),
  h('button', { type: 'submit', id: 'login-submit' }, 'Log in'),
  error);
  fill(main, h('section', { class: 'page page-login' }, login));
  main.querySelector('#login-user').focus();
}

/** Checks the credentials with /api/whoami; keeps them only if the user may use the console. */
async function logIn(user, password, refuse) {
  let answer;
  try {
    answer = await api('GET', '/api/whoami', { login: { user, password } });
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      // A right password without a management tag is refused as well.
      refuse(/none of the tags/.test(error.message)
        ? `Not authorised: user '${user}' has no management tag.`
        : `Not authorised: ${error.message}`);
    } else {
      refuse(error.message);
    }
    return false;
  }
  const tags = Array.isArray(answer.tags) ? answer.tags : String(answer.tags || '').split(',').filter(Boolean);
  const can = abilities(tags);
  if (!can.login) {
    refuse(`Not authorised: user '${user}' has no management tag.`);
    return false;
  }
  saveLogin(user, password);
  me = { name: answer.name, tags, can };
  showNav();
  return true;
}

async function start() {
  window.addEventListener('hashchange', route);
  const saved = savedLogin();
  if (saved && await logIn(saved.user, saved.password, showLogin)) {
    route();
    return;
  }
  if (!saved) showLogin();
}

start();
