// The live operations dashboard: polls admin/v1/dashboard (the session cookie rides along,
// same origin) and updates the page in place. Every value goes in through textContent (never as
// markup), so nothing a tenant or operator typed can become HTML.
(function () {
  "use strict";

  var POLL_MS = 2000;
  var DATA_URL = "admin/v1/dashboard"; // relative: works under an API Gateway stage prefix too
  var timer = null;
  var inFlight = false;

  function $(sel) { return document.querySelector(sel); }

  function text(v) { return v === null || v === undefined ? "-" : String(v); }

  function pct(v) { return v === null || v === undefined ? "-" : (100 * v).toFixed(1) + " %"; }

  function secs(v) {
    if (v === null || v === undefined) return "-";
    if (v < 120) return v.toFixed(0) + " s";
    if (v < 7200) return (v / 60).toFixed(1) + " min";
    return (v / 3600).toFixed(1) + " h";
  }

  function localTime(iso) {
    if (!iso) return "-";
    var d = new Date(iso);
    return isNaN(d.getTime()) ? String(iso) : d.toLocaleTimeString();
  }

  function cell(value, cls) {
    var td = document.createElement("td");
    td.textContent = text(value);
    if (cls) td.className = cls;
    return td;
  }

  function row(key, cells) {
    var tr = document.createElement("tr");
    tr.dataset.key = key;
    cells.forEach(function (c) { tr.appendChild(c); });
    return tr;
  }

  // Rows are matched by key: a row whose cells did not change is left alone, so the page does
  // not flicker and a selection survives the poll.
  function fill(section, rows) {
    var tbody = $("#" + section + " tbody");
    var old = {};
    Array.prototype.forEach.call(tbody.children, function (tr) { old[tr.dataset.key] = tr; });
    var next = rows.map(function (tr) {
      var prev = old[tr.dataset.key];
      if (prev && prev.textContent === tr.textContent && prev.className === tr.className) return prev;
      return tr;
    });
    if (!next.length) {
      var empty = document.createElement("tr");
      empty.dataset.key = "__empty";
      var td = cell("nothing to show", "empty");
      td.colSpan = $("#" + section + " thead tr").children.length;
      empty.appendChild(td);
      next = [empty];
    }
    tbody.replaceChildren.apply(tbody, next);
  }

  function bar(share, entitled) {
    var td = document.createElement("td");
    td.className = "bar";
    var wrap = document.createElement("div");
    wrap.className = "bar-wrap";
    var fillEl = document.createElement("div");
    fillEl.className = "bar-fill";
    fillEl.style.width = Math.min(100, Math.max(0, 100 * (share || 0))).toFixed(1) + "%";
    var mark = document.createElement("div");
    mark.className = "bar-mark";
    mark.style.left = Math.min(100, Math.max(0, 100 * (entitled || 0))).toFixed(1) + "%";
    wrap.appendChild(fillEl);
    wrap.appendChild(mark);
    td.appendChild(wrap);
    var label = document.createElement("span");
    label.textContent = pct(share);
    td.appendChild(label);
    return td;
  }

  function render(doc) {
    $("#generated-at").textContent = localTime(doc.generated_at);
    $("#generated-at").dateTime = doc.generated_at || "";
    if (doc.viewer) $("#operator").textContent = doc.viewer.name + " (" + doc.viewer.role + ")";

    $("#submit-unknown-open").textContent = text(doc.submit_unknown.open);
    $("#manual-review-open").textContent = text(doc.manual_review.open);
    $("#outbox").textContent = text(doc.outbox.pending) + " / " + text(doc.outbox.dead_letters);
    $("#recon-open").textContent = text(doc.reconciliation.open_items);
    $("#wallet-discrepancies").textContent = text(doc.reconciliation.wallet_discrepancies_open);
    var ul = $("#degraded");
    var modes = doc.degraded.map(function (m) {
      var li = document.createElement("li");
      li.className = "bad";
      li.textContent = m.mode + ": " + m.reason;
      return li;
    });
    if (!modes.length) {
      var ok = document.createElement("li");
      ok.className = "good";
      ok.textContent = "none";
      modes = [ok];
    }
    ul.replaceChildren.apply(ul, modes);

    fill("lanes", doc.lanes.map(function (l) {
      var tr = row(l.lane, [
        cell(l.lane, "name"), cell(l.queued_tasks, "num queued-tasks"), cell(l.queued_units, "num queued-units"),
        cell(l.running_tasks, "num running-tasks"), cell(l.running_units, "num running-units"),
        cell(l.borrowed_units, "num borrowed-units"),
        cell(l.used_units + " / " + l.capacity_units + " (" + l.utilisation_percent + " %)", "num"),
        cell(l.borrowable_units ? l.lent_units + " / " + l.borrowable_units : "-", "num"),
        cell(secs(l.oldest_wait_seconds), "num oldest-wait"),
        cell(l.admission_open ? "open" : "closed", l.admission_open ? "good" : "bad")
      ]);
      tr.dataset.lane = l.lane;
      return tr;
    }));

    $("#tenants-window").textContent = "(trailing " + secs(doc.tenants.window_seconds) + ")";
    fill("tenants", doc.tenants.items.map(function (t) {
      var ratio = t.usage_ratio;
      var tr = row(t.tenant_id + "/" + t.lane, [
        cell(t.name, "name"), cell(t.lane), cell(t.weight, "num"), cell(t.delivered_units, "num"),
        cell(t.queued_units, "num"), bar(t.share, t.entitled_share), cell(pct(t.entitled_share), "num"),
        cell(ratio === null ? "-" : ratio.toFixed(2), ratio === null ? "" : (ratio < 0.8 ? "num bad" : "num good"))
      ]);
      tr.dataset.tenant = t.name;
      return tr;
    }));

    fill("providers", doc.providers.map(function (p) {
      var tr = row(p.provider, [
        cell(p.provider, "name"), cell(p.health, p.health === "ok" ? "good" : "bad"),
        cell(p.breaker, p.breaker === "open" ? "bad" : "good"),
        cell(p.running + " / " + p.capacity + " (" + p.utilisation_percent + " %)", "num provider-running"),
        cell(pct(p.success_rate), "num"), cell(p.samples, "num"), cell(secs(p.mean_latency_seconds), "num"),
        cell(p.submit_unknown_open, p.submit_unknown_open ? "num bad" : "num"),
        cell(p.manual_review_open, p.manual_review_open ? "num bad" : "num")
      ]);
      tr.dataset.provider = p.provider;
      return tr;
    }));

    fill("reviews", doc.manual_review.by_reason.map(function (r) {
      return row(r.reason, [cell(r.reason, "name"), cell(r.open, "num"), cell(secs(r.oldest_wait_seconds), "num")]);
    }));

    fill("reconciliation", doc.reconciliation.providers.map(function (r) {
      return row(r.provider, [
        cell(r.provider, "name"), cell(r.status, r.healthy ? "good" : "bad"), cell(r.billing_date),
        cell(localTime(r.finished_at)), cell(r.open_items, r.open_items ? "num bad" : "num"), cell(r.oldest_open_day)
      ]);
    }));

    fill("audit", doc.audit.map(function (a) {
      return row(String(a.audit_id), [
        cell(new Date(a.created_at).toLocaleString()), cell(a.operator), cell(a.action), cell(a.target)
      ]);
    }));
  }

  function setStatus(kind, label) {
    var s = $("#status");
    s.className = "status " + kind;
    s.textContent = label;
  }

  function poll() {
    if (inFlight) return;
    inFlight = true;
    fetch(DATA_URL, { credentials: "same-origin", cache: "no-store", headers: { "Accept": "application/json" } })
      .then(function (resp) {
        if (resp.status === 401 || resp.status === 403) {
          // The session ended (token revoked or rotated): back to the sign-in form.
          setStatus("bad", "signed out");
          clearInterval(timer);
          window.location.replace("dashboard");
          return null;
        }
        if (!resp.ok) throw new Error("HTTP " + resp.status);
        return resp.json();
      })
      .then(function (doc) {
        if (!doc) return;
        render(doc);
        var now = new Date();
        $("#updated-at").textContent = now.toLocaleTimeString();
        $("#updated-at").dateTime = now.toISOString();
        setStatus("good", "live");
      })
      .catch(function (err) { setStatus("bad", "stale: " + err.message); })
      .then(function () { inFlight = false; });
  }

  document.addEventListener("DOMContentLoaded", function () {
    poll();
    timer = setInterval(poll, POLL_MS);
  });
})();
