// firsttoken dashboard: draws the metrics JSON endpoints with uPlot; no build step.
//
// The key lives in sessionStorage only (gone with the tab) and leaves the page only as an
// Authorization header of same-origin fetch() calls: never in a URL, never logged. Every
// string from the server is written with textContent, never parsed as HTML.
// What was last plotted is kept on window.__dashboard, for the browser test and for curious
// operators in the console.
(function () {
  'use strict';

  const KEY_SLOT = 'firsttoken.dashboard.key';
  const TENANT_SLOT = 'firsttoken.dashboard.tenant';
  const MAX_ROUTES = 8; // per-route charts: one series request per route
  const FETCH_TIMEOUT_MS = 10000;
  const CHART_HEIGHT = 250;
  const COLORS = ['#1f6feb', '#e8710a', '#2e7d32', '#8e24aa', '#00838f', '#c0ca33', '#6d4c41',
    '#d81b60'];
  const SLO_COLOR = '#c62828';
  // Steps per window: about 60 points, a multiple of 60 s as the series endpoint wants.
  const STEPS = { 900: 60, 3600: 60, 21600: 300, 86400: 1800 };

  // What each prefix-break class of the cache advisor means, and which opt-ins address it.
  const BREAKS = {
    'tools(order)': {
      block: 'order of the tools',
      fix: 'the client sends its tools in a changing order: ' +
        'turn on FIRSTTOKEN_CANONICALIZE_SORT_TOOLS',
      opt_ins: ['CANONICALIZE_SORT_TOOLS'],
    },
    tools: {
      block: 'a tool definition',
      fix: 'a tool definition changes between requests: if only its keys move, turn on ' +
        'FIRSTTOKEN_CANONICALIZE_SORT_SCHEMA_KEYS; otherwise keep tool definitions fixed',
      opt_ins: ['CANONICALIZE_SORT_SCHEMA_KEYS'],
    },
    params: {
      block: 'tool_choice / response_format',
      fix: 'keep tool_choice and response_format the same from request to request',
      opt_ins: [],
    },
    system: {
      block: 'the system prompt',
      fix: 'a clock or id in the system prompt: turn on FIRSTTOKEN_CANONICALIZE_VOLATILE',
      opt_ins: ['CANONICALIZE_VOLATILE'],
    },
    messages: {
      block: 'an earlier message',
      fix: 'earlier turns change: if retrieved <passage> blocks move, turn on ' +
        'FIRSTTOKEN_CANONICALIZE_SORT_PASSAGES; if tool results are re-serialized, ' +
        'FIRSTTOKEN_SLIM_MINIFY_JSON; otherwise keep the history append-only',
      opt_ins: ['CANONICALIZE_SORT_PASSAGES', 'SLIM_DEDUPE_PASSAGES', 'SLIM_MINIFY_JSON'],
    },
  };

  const $ = (id) => document.getElementById(id);
  const state = {
    key: null, who: null, tenant: null, timer: null, generation: 0, charts: {}, lastIdx: null,
  };
  const exposed = {
    who: null, tenant: null, window_s: null, step_s: null, updates: 0, error: null,
    routes: [], charts: {}, tables: {}, advice: [], fleet: null,
  };
  window.__dashboard = exposed;

  // ---------------------------------------------------------------- storage and requests

  function storedKey() {
    try { return sessionStorage.getItem(KEY_SLOT); } catch (e) { return null; }
  }

  function storeKey(key) {
    try { sessionStorage.setItem(KEY_SLOT, key); } catch (e) { /* private mode: tab memory */ }
  }

  function forgetKey() {
    try {
      sessionStorage.removeItem(KEY_SLOT);
      sessionStorage.removeItem(TENANT_SLOT);
    } catch (e) { /* nothing stored */ }
  }

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(path, params) {
    const url = new URL(path, window.location.origin);
    for (const [name, value] of Object.entries(params || {})) {
      if (value !== null && value !== undefined) url.searchParams.set(name, String(value));
    }
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
    let response;
    try {
      response = await fetch(url, {
        headers: { Authorization: 'Bearer ' + state.key, Accept: 'application/json' },
        cache: 'no-store',
        credentials: 'omit',
        referrerPolicy: 'no-referrer',
        signal: controller.signal,
      });
    } catch (e) {
      throw new ApiError(0, e.name === 'AbortError' ? 'no answer within 10 s' : 'gateway unreachable');
    } finally {
      clearTimeout(timer);
    }
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (!response.ok) {
      const message = body && body.error && body.error.message;
      throw new ApiError(response.status, message || 'HTTP ' + response.status);
    }
    return body;
  }

  // ---------------------------------------------------------------- formatting

  function fmtMs(v) {
    if (v === null || v === undefined) return '–';
    if (v >= 10000) return (v / 1000).toFixed(1) + ' s';
    return (v >= 100 ? Math.round(v) : v.toFixed(1)) + ' ms';
  }
  const fmtPct = (v) => (v === null || v === undefined ? '–' : (100 * v).toFixed(1) + '%');
  const fmtInt = (v) => (v === null || v === undefined ? '–' : Math.round(v).toLocaleString('en-US'));
  const fmtPctPoints = (v, digits) => (v === null || v === undefined ? '–'
    : v.toFixed(digits === undefined ? 1 : digits) + '%');
  const fmtX = (v) => (v === null || v === undefined ? '–' : v.toFixed(2) + '×');
  // The error budget left, bounded: a percentage while some is left, else how many times over
  // it the misses went (the budget's burn: `1 - remaining`, at most 1 / (1 - objective)).
  function fmtBudget(v) {
    if (v === null || v === undefined) return '–';
    if (v >= 0) return fmtPct(v);
    const times = 1 - v;
    return 'over budget ×' + (times < 10 ? times.toFixed(1) : Math.round(times).toLocaleString('en-US'));
  }

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  // A table scrolls inside its card on a narrow screen, never the page.
  function scrolling(table) {
    const box = el('div', null, 'table-scroll');
    box.appendChild(table);
    return box;
  }

  function fillTable(table, headers, rows, numeric) {
    table.replaceChildren();
    const head = el('tr');
    headers.forEach((h, i) => head.appendChild(el('th', h, numeric[i] ? 'num' : '')));
    table.appendChild(el('thead')).appendChild(head);
    const body = table.appendChild(el('tbody'));
    if (!rows.length) {
      const cell = el('td', 'nothing in this window', 'muted');
      cell.colSpan = headers.length;
      body.appendChild(el('tr')).appendChild(cell);
    }
    for (const row of rows) {
      const tr = body.appendChild(el('tr'));
      row.forEach((value, i) => {
        const cell = tr.appendChild(el('td', value, numeric[i] ? 'num' : ''));
        if (typeof value === 'string' && value.startsWith('state:')) {
          cell.textContent = value.slice(6);
          cell.className = 'state-' + value.slice(6);
        }
      });
    }
  }

  // ---------------------------------------------------------------- charts

  function pick(points, figure, quantile) {
    return points.map((p) => (p.count && p[figure] ? p[figure][quantile] : null));
  }

  function chartWidth(node) {
    return Math.max(200, Math.floor(node.clientWidth || 600));
  }

  // Creates the chart, or feeds new data to the one there when its series are the same.
  function drawChart(id, options, data) {
    const node = $('chart-' + id);
    const signature = JSON.stringify(options.series.map((s) => s.label || ''));
    let chart = state.charts[id];
    if (chart && chart.signature === signature) {
      chart.plot.setData(data);
    } else {
      if (chart) chart.plot.destroy();
      node.replaceChildren();
      const plot = new window.uPlot(
        Object.assign({ width: chartWidth(node), height: CHART_HEIGHT }, options), data, node);
      chart = state.charts[id] = { plot, signature };
    }
    // With no cursor on the chart, the legend reads the newest step with requests.
    // (after uPlot's own commit of the new data, which resets the legend to the cursor).
    const plot = chart.plot;
    const idx = state.lastIdx;
    if (idx !== null) setTimeout(() => { if (state.charts[id] && state.charts[id].plot === plot) plot.setLegend({ idx }); }, 0);
    const shown = exposed.charts[id] = {
      labels: options.series.slice(1).map((s) => s.label),
      data: chart.plot.data.map((column) => Array.from(column)),
    };
    // The y range uPlot settled on, once it committed the data.
    setTimeout(() => { shown.y_range = [plot.scales.y.min, plot.scales.y.max]; }, 0);
  }

  function resizeCharts() {
    for (const [id, chart] of Object.entries(state.charts)) {
      chart.plot.setSize({ width: chartWidth($('chart-' + id)), height: CHART_HEIGHT });
    }
  }

  const timeAxis = { stroke: '#6a7384', grid: { stroke: '#eef0f3' } };
  function valueAxis(format, extra) {
    return Object.assign({
      stroke: '#6a7384', grid: { stroke: '#eef0f3' }, size: 72,
      values: (u, splits) => splits.map((v) => (v === null || v === undefined ? '' : format(v))),
    }, extra || {});
  }

  // A step with requests between empty ones draws no line: such steps get a dot.
  function isolated(u, seriesIdx) {
    const ys = u.data[seriesIdx];
    const out = [];
    for (let i = 0; i < ys.length; i++) {
      if (ys[i] !== null && (i === 0 || ys[i - 1] === null) && (i === ys.length - 1 || ys[i + 1] === null)) {
        out.push(i);
      }
    }
    return out;
  }

  function line(label, color, extra) {
    return Object.assign({
      label, stroke: color, width: 2, spanGaps: false,
      points: { show: true, size: 5, fill: color, filter: isolated },
    }, extra || {});
  }

  function drawTtft(xs, perRoute, sloMs) {
    const series = [{}];
    const data = [xs];
    perRoute.forEach(({ route, points }, i) => {
      const color = COLORS[i % COLORS.length];
      series.push(line(route + ' p50', color, { value: (u, v) => fmtMs(v) }));
      data.push(pick(points, 'ttft_ms', 'p50'));
      series.push(line(route + ' p99', color, { dash: [6, 4], value: (u, v) => fmtMs(v) }));
      data.push(pick(points, 'ttft_ms', 'p99'));
    });
    series.push(line('SLO ' + fmtMs(sloMs), SLO_COLOR,
      { width: 1.5, dash: [2, 3], points: { show: false }, value: (u, v) => fmtMs(v) }));
    data.push(xs.map(() => sloMs));
    drawChart('ttft', {
      series,
      scales: { x: { time: true }, y: { distr: 3, log: 10 } },
      axes: [timeAxis, valueAxis(fmtMs)],
    }, data);
  }

  function drawSplit(xs, points) {
    const upstream = pick(points, 'upstream_ttft_ms', 'p50');
    const gateway = pick(points, 'gateway_ms', 'p50');
    const stacked = upstream.map((u, i) => (u === null || gateway[i] === null ? null : u + gateway[i]));
    const share = points.map((p) => (p.count && p.gateway_share !== null ? 100 * p.gateway_share : null));
    // The stacked total is drawn first and the upstream area over it: what shows of the total
    // is the gateway's part. Its legend reads the gateway's own milliseconds.
    drawChart('split', {
      series: [
        {},
        line('gateway p50 (on top)', '#e8710a', {
          fill: '#f9c99b', value: (u, v, s, i) => (i === null ? '–' : fmtMs(gateway[i])),
        }),
        line('upstream p50', '#1f6feb', { fill: '#b9d3fb', value: (u, v) => fmtMs(v) }),
        line('gateway share', '#5d4037', {
          scale: '%', width: 1.5, dash: [4, 3], value: (u, v) => fmtPctPoints(v),
        }),
      ],
      // From 0: the stack's height is the TTFT, which an axis cut above 0 would misstate.
      scales: {
        x: { time: true },
        y: { range: (u, min, max) => [0, Math.max(1, (max || 0) * 1.1)] },
        '%': { range: (u, min, max) => [0, Math.max(5, max * 1.2)] },
      },
      axes: [timeAxis, valueAxis(fmtMs),
        valueAxis((v) => v.toFixed(1) + '%', { scale: '%', side: 1, grid: { show: false } })],
    }, [xs, stacked, upstream, share]);
    exposed.charts.split.gateway_ms = gateway.slice();
  }

  function drawCached(xs, perRoute) {
    const series = [{}];
    const data = [xs];
    perRoute.forEach(({ route, points }, i) => {
      series.push(line(route, COLORS[i % COLORS.length],
        { value: (u, v) => fmtPctPoints(v) }));
      data.push(points.map((p) => (p.count && p.cached_share !== null ? 100 * p.cached_share : null)));
    });
    drawChart('cached', {
      series,
      scales: { x: { time: true }, y: { range: [0, 100] } },
      axes: [timeAxis, valueAxis((v) => v + '%')],
    }, data);
  }

  function drawSaved(xs, perRoute) {
    const series = [{}];
    const data = [xs];
    perRoute.forEach(({ route, points }, i) => {
      series.push(line(route, COLORS[i % COLORS.length], { value: (u, v) => fmtInt(v) }));
      data.push(points.map((p) => (p.count ? p.prompt_tokens_saved : null)));
    });
    drawChart('saved', {
      series,
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(10, max * 1.1)] } },
      axes: [timeAxis, valueAxis((v) => fmtInt(v))],
    }, data);
  }

  function drawSlo(xs, points, objective) {
    const attainment = points.map((p) => (p.slo_attainment === null ? null : 100 * p.slo_attainment));
    // Burn rate: the step's misses over the misses the objective allows (1x spends the
    // budget exactly as fast as the objective permits).
    const burn = points.map((p) => (p.slo_attainment === null ? null
      : (1 - p.slo_attainment) / (1 - objective)));
    drawChart('slo', {
      series: [
        {},
        line('attainment', '#2e7d32', { value: (u, v) => fmtPctPoints(v, 2) }),
        line('objective ' + (100 * objective).toFixed(1) + '%', SLO_COLOR,
          { width: 1.5, dash: [2, 3], points: { show: false }, value: (u, v) => fmtPctPoints(v) }),
        line('budget burn', '#8e24aa', { scale: 'burn', value: (u, v) => fmtX(v) }),
      ],
      scales: {
        x: { time: true },
        y: { range: (u, min, max) => [Math.min(min === null ? 90 : min, 100 * objective) - 1, 100.5] },
        burn: { range: (u, min, max) => [0, Math.max(2, (max || 0) * 1.2)] },
      },
      axes: [timeAxis, valueAxis((v) => v.toFixed(1) + '%'),
        valueAxis((v) => v.toFixed(1) + '×', { scale: 'burn', side: 1, grid: { show: false } })],
    }, [xs, attainment, xs.map(() => 100 * objective), burn]);
  }

  // ---------------------------------------------------------------- tables

  // [{tenant|null, route figures}] of a report: one tenant's, or every tenant's for '*'.
  function reportRoutes(report) {
    if (Array.isArray(report.tenants)) {
      return report.tenants.flatMap((t) => t.routes.map((r) => ({ tenant: t.tenant, figures: r })));
    }
    return (report.routes || []).map((r) => ({ tenant: null, figures: r }));
  }

  function drawRoutes(report, windowS) {
    const all = reportRoutes(report);
    const several = all.some((r) => r.tenant !== null);
    const headers = [...(several ? ['tenant'] : []), 'route', 'requests', 'errors', 'TTFT p50',
      'TTFT p99', 'upstream p50', 'gateway p50', 'cached share', 'tokens saved', 'SLO target',
      'attainment', 'budget left'];
    const numeric = headers.map((h) => !['tenant', 'route'].includes(h));
    const rows = all.map(({ tenant, figures: r }) => [
      ...(several ? [tenant] : []), r.route, fmtInt(r.count), fmtInt(r.errors),
      fmtMs(r.ttft_ms.p50), fmtMs(r.ttft_ms.p99), fmtMs(r.upstream_ttft_ms.p50),
      fmtMs(r.gateway_ms.p50), fmtPct(r.cache_hit_ratio), fmtInt(r.prompt_tokens_saved),
      fmtMs(r.slo.target_ms), fmtPct(r.slo.attainment), fmtBudget(r.slo.budget_remaining),
    ]);
    fillTable($('routes-table'), headers, rows, numeric);
    $('routes-caption').textContent = 'last ' + windowLabel(windowS);
    exposed.tables.routes = all.map(({ tenant, figures }) => ({
      tenant, route: figures.route, count: figures.count, errors: figures.errors,
      budget: fmtBudget(figures.slo.budget_remaining),
    }));
  }

  function windowLabel(windowS) {
    const option = $('window').querySelector('option[value="' + windowS + '"]');
    return option ? option.textContent : windowS + ' s';
  }

  function adviceFamilies(answer) {
    if (!answer) return [];
    const answers = Array.isArray(answer.tenants) ? answer.tenants : [answer];
    return answers.flatMap((a) => (a.families || []).map((f) => ({ tenant: a.tenant, family: f })));
  }

  function adviceSummaries(answer) {
    if (!answer) return [];
    const answers = Array.isArray(answer.tenants) ? answer.tenants : [answer];
    return answers.filter((a) => a.summary)
      .map((a) => ({ tenant: a.tenant, family: { ...a.summary, family: 'all' } }));
  }

  function drawAdvice(answer, problem, several) {
    const list = $('advice');
    list.replaceChildren();
    const families = adviceFamilies(answer);
    exposed.advice = [];
    if (problem) {
      list.appendChild(el('li', 'cache advice unavailable: ' + problem, 'muted'));
    } else if (!families.length) {
      list.appendChild(el('li', 'no prefix families seen in this window', 'muted'));
    }
    // A family with an opt-in to turn on gets its own line; the others, whose advice is that
    // nothing would pay (or not yet), one summary line per such advice.
    const quiet = new Map();
    for (const { tenant, family: f } of families) {
      exposed.advice.push(f.advice);
      if (!f.advice.startsWith('turn on')) {
        const seen = quiet.get(f.advice) || { families: 0, requests: 0 };
        seen.families += 1;
        seen.requests += f.requests || 0;
        quiet.set(f.advice, seen);
        continue;
      }
      const who = (several ? tenant + ' · ' : '') + 'family ' + f.family;
      const text = f.advice + ' (' + who + ', ' + fmtInt(f.requests) + ' requests, cached now ' +
        fmtPct(f.observed_cached_share) + ')';
      list.appendChild(el('li', text));
    }
    for (const [advice, seen] of quiet) {
      const n = seen.families;
      const scope = list.childElementCount
        ? 'the other ' + (n === 1 ? 'family' : fmtInt(n) + ' families')
        : (n === 1 ? 'the one prefix family' : 'all ' + fmtInt(n) + ' prefix families');
      list.appendChild(el('li', advice + ' for ' + scope + ' (' + fmtInt(seen.requests) +
        ' requests)', 'muted'));
    }
    exposed.advice_lines = Array.from(list.children).map((item) => item.textContent);
    const rows = [];
    // Breaks are counted per tenant for every request (the header's and Prometheus' events);
    // the advisor's figures for the opt-ins that address them are summed over its families.
    for (const { tenant, family: f } of adviceSummaries(answer)) {
      for (const [kind, count] of Object.entries(f.break_kinds || {})) {
        const meaning = BREAKS[kind] || { block: kind, fix: 'see the x-firsttoken-prefix-break header', opt_ins: [] };
        const gains = meaning.opt_ins
          .map((name) => [name, f.variants && f.variants[name] && f.variants[name].gain_points])
          .filter(([, gain]) => gain > 0)
          .map(([name, gain]) => 'FIRSTTOKEN_' + name + ' +' + gain.toFixed(0) + '%');
        rows.push({ tenant, family: String(f.family), kind, block: meaning.block, count,
          fix: meaning.fix + (gains.length ? ' (advisor: ' + gains.join(', ') + ')' : '') });
      }
    }
    rows.sort((a, b) => b.count - a.count);
    const headers = [...(several ? ['tenant'] : []), 'family', 'kind', 'block', 'count', 'what to change'];
    fillTable($('breaks-table'), headers,
      rows.map((r) => [...(several ? [r.tenant] : []), r.family, r.kind, r.block, fmtInt(r.count), r.fix]),
      headers.map((h) => h === 'count'));
    exposed.tables.breaks = rows;
  }

  function drawFleet(replicas) {
    const card = $('fleet-card');
    const routes = replicas ? Object.entries(replicas) : [];
    card.hidden = !routes.length;
    exposed.fleet = replicas || null;
    const box = $('fleet');
    box.replaceChildren();
    for (const [route, fleet] of routes) {
      const part = box.appendChild(el('div', null, 'fleet-route'));
      const hedges = fleet.hedges || {};
      part.appendChild(el('h3', route + ' · balance ' + fleet.balance + ' · hedges sent ' +
        fmtInt(hedges.sent || 0) + ', won ' + fmtInt(hedges.won || 0) + ', lost ' + fmtInt(hedges.lost || 0)));
      const headers = ['replica', 'state', 'in flight', 'queue', 'KV usage', 'requests',
        'affinity hits', 'errors', 'ejections', 'upstream TTFT mean'];
      const table = el('table', null, 'table');
      part.appendChild(scrolling(table));
      fillTable(table, headers, fleet.replicas.map((r) => [
        r.name, 'state:' + r.state, fmtInt(r.in_flight),
        r.queue === null ? '–' : fmtInt(r.queue), r.kv_usage === null ? '–' : fmtPct(r.kv_usage),
        fmtInt(r.requests), fmtInt(r.affinity_hits), fmtInt(r.errors), fmtInt(r.ejections),
        fmtMs(r.upstream_ttft_mean_ms),
      ]), headers.map((h, i) => i >= 2));
    }
  }

  function updatePicker(report) {
    if (!state.who.admin) return;
    const picker = $('tenant-picker');
    const known = new Set(Array.from(picker.options).map((o) => o.value));
    const names = Array.isArray(report.tenants) ? report.tenants.map((t) => t.tenant) : [];
    for (const name of ['*', state.tenant, ...names.sort()]) {
      if (name && !known.has(name)) {
        const option = el('option', name === '*' ? 'all tenants (*)' : name);
        option.value = name;
        picker.appendChild(option);
        known.add(name);
      }
    }
    picker.value = state.tenant;
  }

  // ---------------------------------------------------------------- refresh loop

  function schedule() {
    clearTimeout(state.timer);
    const seconds = Number($('refresh').value);
    if (seconds > 0 && state.key) state.timer = setTimeout(refresh, seconds * 1000);
  }

  function setStatus(text, stale) {
    const node = $('status');
    node.textContent = text;
    node.classList.toggle('stale', Boolean(stale));
  }

  async function refresh() {
    if (!state.key) return;
    const generation = ++state.generation;
    clearTimeout(state.timer);
    if (document.hidden) { schedule(); return; } // no polling from a background tab
    const windowS = Number($('window').value);
    const step = STEPS[windowS] || 60;
    const tenant = state.who.admin ? state.tenant : null; // a tenant key reads its own
    try {
      const [report, total] = await Promise.all([
        api('/v1/metrics/ttft', { window: windowS, tenant }),
        api('/v1/metrics/ttft/series', { window: windowS, step, tenant }),
      ]);
      const routes = total.routes.slice(0, MAX_ROUTES);
      const perRoute = await Promise.all(routes.map((route) =>
        api('/v1/metrics/ttft/series', { window: windowS, step, tenant, route })
          .then((answer) => ({ route, points: answer.points }))));
      let advice = null;
      let adviceProblem = null;
      try {
        advice = await api('/v1/metrics/cache-advice', { window: windowS, tenant });
      } catch (e) {
        if (e.status === 401) throw e;
        adviceProblem = e.message;
      }
      if (generation !== state.generation) return; // a newer refresh has started
      const xs = total.points.map((p) => p.t);
      // Per-route answers can straddle a step boundary: align them on the total's steps.
      const aligned = perRoute.map(({ route, points }) => {
        const byT = new Map(points.map((p) => [p.t, p]));
        return { route, points: xs.map((t) => byT.get(t) || { t, count: 0 }) };
      });
      const objective = (reportRoutes(report)[0] || { figures: { slo: { objective: 0.99 } } })
        .figures.slo.objective;
      const several = tenant === '*';
      const busy = total.points.map((p) => p.count > 0).lastIndexOf(true);
      state.lastIdx = busy >= 0 ? busy : null;
      $('board-error').textContent = '';
      drawRoutes(report, windowS);
      drawTtft(xs, aligned, total.slo_ms);
      drawSplit(xs, total.points);
      drawCached(xs, aligned);
      drawSaved(xs, aligned);
      drawSlo(xs, total.points, objective);
      drawAdvice(advice, adviceProblem, several);
      drawFleet(report.replicas);
      updatePicker(report);
      Object.assign(exposed, {
        tenant: total.tenant, window_s: windowS, step_s: step, routes, error: null,
        slo_ms: total.slo_ms, objective,
      });
      exposed.updates += 1;
      setStatus('updated ' + new Date().toLocaleTimeString());
    } catch (e) {
      if (generation !== state.generation) return;
      exposed.error = e.message;
      if (e.status === 401) { signOut('That key was refused: ' + e.message); return; }
      $('board-error').textContent = e.message;
      setStatus('stale: ' + e.message, true);
    }
    schedule();
  }

  // ---------------------------------------------------------------- signing in and out

  async function signIn(key) {
    state.key = key;
    let who;
    try {
      who = await api('/dashboard/whoami');
    } catch (e) {
      signOut(e.status === 401 ? 'That key was refused: ' + e.message : e.message);
      return;
    }
    storeKey(key);
    state.who = who;
    exposed.who = who;
    let saved = null;
    try { saved = sessionStorage.getItem(TENANT_SLOT); } catch (e) { saved = null; }
    state.tenant = who.admin ? (saved || '*') : who.tenant;
    $('who').textContent = who.admin ? 'admin' : 'tenant ' + who.tenant;
    $('tenant-picker-label').hidden = !who.admin;
    $('sign-in').hidden = true;
    $('board').hidden = false;
    $('controls').hidden = false;
    updatePicker({});
    refresh();
  }

  function signOut(message) {
    state.generation += 1;
    clearTimeout(state.timer);
    forgetKey();
    state.key = null;
    state.who = null;
    for (const chart of Object.values(state.charts)) chart.plot.destroy();
    state.charts = {};
    for (const id of ['routes-table', 'breaks-table', 'advice', 'fleet', 'tenant-picker']) $(id).replaceChildren();
    Object.assign(exposed, { who: null, tenant: null, routes: [], charts: {}, tables: {}, advice: [], fleet: null });
    $('board').hidden = true;
    $('controls').hidden = true;
    $('sign-in').hidden = false;
    $('sign-in-error').textContent = message || '';
    $('key').value = '';
    $('key').focus();
  }

  function start() {
    $('key-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const key = $('key').value.trim();
      $('key').value = '';
      if (key) signIn(key);
    });
    $('sign-out').addEventListener('click', () => signOut(''));
    $('window').addEventListener('change', refresh);
    $('refresh').addEventListener('change', refresh);
    $('tenant-picker').addEventListener('change', (event) => {
      state.tenant = event.target.value;
      try { sessionStorage.setItem(TENANT_SLOT, state.tenant); } catch (e) { /* tab memory */ }
      refresh();
    });
    document.addEventListener('visibilitychange', () => { if (!document.hidden) refresh(); });
    let resizing = null;
    window.addEventListener('resize', () => {
      clearTimeout(resizing);
      resizing = setTimeout(resizeCharts, 100);
    });
    const key = storedKey();
    if (key) signIn(key); else $('key').focus();
  }

  start();
}());
