// The shell: navigation, the hash router and the connection banner. Each
// page module exports mount(root, params) and returns its cleanup function.
import { connection } from './api.js';
import { h, replace } from './dom.js';
import * as overview from './page-overview.js';
import * as models from './page-models.js';
import * as jobs from './page-jobs.js';
import * as job from './page-job.js';
import * as chat from './page-chat.js';
import * as api from './page-api.js';

const ROUTES = [
  { pattern: /^\/?$/, page: overview, nav: 'overview', title: 'Overview' },
  { pattern: /^\/models\/?$/, page: models, nav: 'models', title: 'Models' },
  { pattern: /^\/jobs\/?$/, page: jobs, nav: 'jobs', title: 'Jobs' },
  { pattern: /^\/jobs\/([^/]+)$/, page: job, nav: 'jobs', title: 'Job' },
  { pattern: /^\/chat\/?$/, page: chat, nav: 'chat', title: 'Chat' },
  { pattern: /^\/api\/?$/, page: api, nav: 'api', title: 'API' },
];

const main = document.getElementById('main');
const banner = document.getElementById('connection-banner');
let cleanup = null;

function parseHash() {
  const raw = location.hash.replace(/^#/, '') || '/';
  const [path, query = ''] = raw.split('?');
  return { path, query: new URLSearchParams(query) };
}

function route() {
  const { path, query } = parseHash();
  if (cleanup) { cleanup(); cleanup = null; }
  const match = ROUTES.map((r) => ({ r, m: r.pattern.exec(path) })).find(({ m }) => m);
  for (const link of document.querySelectorAll('nav.primary a')) {
    if (match && link.dataset.nav === match.r.nav) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  const root = h('div', { class: 'page' });
  replace(main, root);
  if (!match) {
    document.title = 'Not found · gpuvisor';
    root.append(h('h1', { tabindex: -1, text: 'Page not found' }),
      h('p', {}, 'Nothing lives at ', h('code', { text: path }), '. ', h('a', { href: '#/', text: 'Go to the overview' }), '.'));
    return;
  }
  document.title = `${match.r.title} · gpuvisor`;
  const params = match.m.slice(1).map(decodeURIComponent);
  cleanup = match.r.page.mount(root, params, query) || null;
  // Move focus to the new page's heading so keyboard and screen reader users follow.
  const heading = root.querySelector('h1');
  if (heading && document.activeElement?.closest('nav.primary')) {
    heading.tabIndex = -1;
    heading.focus({ preventScroll: true });
  }
}

connection.addEventListener('offline', () => { banner.hidden = false; });
connection.addEventListener('online', () => { banner.hidden = true; });
window.addEventListener('hashchange', route);
// The skip link must not change the hash: the hash is the route.
document.querySelector('.skip-link')?.addEventListener('click', (ev) => {
  ev.preventDefault();
  const target = main.querySelector('h1') || main;
  target.tabIndex = -1;
  target.focus();
});

const version = document.querySelector('meta[name="gpuvisor-version"]')?.content;
if (version) document.getElementById('version').textContent = `v${version}`;
route();
