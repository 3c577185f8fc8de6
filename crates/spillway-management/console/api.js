// Calls to the management HTTP API (/api/...), with the logged-in user's
// HTTP Basic credentials. The credentials stay in sessionStorage: they go
// when the tab is closed, and other sites cannot read them.

const STORE = 'spillway.console.login';

/** The stored login ({user, password}) or null. */
export function savedLogin() {
  try {
    const login = JSON.parse(sessionStorage.getItem(STORE));
    return login && typeof login.user === 'string' ? login : null;
  } catch {
    return null;
  }
}

export function saveLogin(user, password) {
  sessionStorage.setItem(STORE, JSON.stringify({ user, password }));
}

export function forgetLogin() {
  sessionStorage.removeItem(STORE);
}

/** An answer other than 2xx: `status`, and the API's `error` and `reason`. */
export class ApiError extends Error {
  constructor(status, error, reason) {
    super(reason || error || `HTTP ${status}`);
    this.status = status;
    this.error = error;
  }
}

/** A URL path with each value percent-encoded ('/' is %2F): path`/api/queues/${vhost}/${name}`. */
export function path(strings, ...values) {
  return strings.reduce((out, text, i) => out + text + (i < values.length ? encodeURIComponent(values[i]) : ''), '');
}

/** A query string from an object, without empty values. */
export function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== '') search.set(key, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : '';
}

function basic(login) {
  // btoa takes Latin-1 only: encode the UTF-8 bytes of user:password.
  const utf8 = new TextEncoder().encode(`${login.user}:${login.password}`);
  return `Basic ${btoa(String.fromCharCode(...utf8))}`;
}

/**
 * One call: the JSON answer (null when there is none). Throws ApiError.
 * `credentials: 'omit'` keeps the browser from opening its own login
 * dialog on a 401: the console shows its login form instead.
 */
export async function api(method, url, { body, headers = {}, login = savedLogin() } = {}) {
  const init = { method, credentials: 'omit', cache: 'no-store', headers: { ...headers } };
  if (login) init.headers.authorization = basic(login);
  if (body !== undefined) {
    init.headers['content-type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url, init);
  } catch (error) {
    throw new ApiError(0, 'network', `the broker did not answer (${error.message})`);
  }
  const text = await response.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch {
    json = null;
  }
  if (!response.ok) {
    throw new ApiError(response.status, json && json.error, (json && json.reason) || text.slice(0, 200));
  }
  return json;
}

export const get = (url) => api('GET', url);
export const put = (url, body) => api('PUT', url, { body });
export const post = (url, body) => api('POST', url, { body });
export const del = (url, headers) => api('DELETE', url, { headers });
