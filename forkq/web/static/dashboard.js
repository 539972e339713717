// Behaviour the pages can live without: confirmation before destructive buttons, and on
// the overview a poll of stats.json every two seconds that feeds the chart and totals.
"use strict";

document.addEventListener("click", function (event) {
  var button = event.target.closest("button[data-confirm]");
  if (button && !window.confirm(button.getAttribute("data-confirm"))) event.preventDefault();
});

document.addEventListener("DOMContentLoaded", function () {
  var canvas = document.getElementById("rate-chart");
  if (!canvas || typeof RateChart === "undefined") return;
  var chart = new RateChart(canvas, [{ name: "processed", color: "#16a34a" },
                                     { name: "failed", color: "#dc2626" }]);
  var status = document.getElementById("rate-now");
  var samples = [];   // recent stats.json answers, oldest first
  // Workers add to the counters in batches (each process flushes every few seconds), so a
  // rate between two polls 2 s apart jumps between zero and a spike; a rate over the last
  // WINDOW seconds reads like the real throughput.
  var WINDOW = 10;

  function show(sample) {
    document.querySelectorAll("[data-stat]").forEach(function (el) {
      var value = sample[el.getAttribute("data-stat")];
      if (typeof value === "number") el.textContent = value.toLocaleString();
    });
    if (sample.queues) showQueues(sample.queues);
    var last = samples[samples.length - 1];
    if (last && sample.time <= last.time) return;
    samples.push(sample);
    while (samples.length > 2 && sample.time - samples[1].time >= WINDOW) samples.shift();
    var first = samples[0], dt = sample.time - first.time;
    if (dt < 3.5) return;  // one poll apart is too short a span to say anything
    // counters can go down (someone reset the stats): show zero, not a negative rate
    var done = Math.max(0, sample.processed - first.processed) / dt;
    var failed = Math.max(0, sample.failed - first.failed) / dt;
    chart.push(sample.time, [done, failed]);
    status.textContent = done.toFixed(1) + " processed/s, " + failed.toFixed(1) + " failed/s" +
      " (over the last " + Math.round(dt) + " s)";
  }

  // the queue table, rebuilt from text nodes only: queue names come from Redis
  function showQueues(queues) {
    var body = document.getElementById("queue-rows");
    if (!body) return;
    var root = document.body.getAttribute("data-root");
    // the Suspects column shows while any queue has crash suspects
    var any = queues.some(function (q) { return q.suspects > 0; });
    document.getElementById("queue-table").classList.toggle("no-suspects", !any);
    var rows = queues.map(function (q) {
      var tr = document.createElement("tr");
      var cells = [q.name, q.size.toLocaleString(), (q.suspects || 0).toLocaleString(), age(q.latency)];
      cells.forEach(function (text, i) {
        var td = document.createElement("td");
        if (i > 0) td.className = i === 2 ? "num suspects" : "num";
        var cell = td;
        if (i === 0) {  // the name links to the queue's page, as the server-drawn table does
          cell = document.createElement("a");
          cell.href = root + "/queues/" + encodeURIComponent(q.name).replace(/%2F/g, "/");
          td.appendChild(cell);
        }
        cell.textContent = text;
        tr.appendChild(td);
      });
      return tr;
    });
    body.replaceChildren.apply(body, rows);
  }

  function age(seconds) {
    var units = [["d", 86400], ["h", 3600], ["m", 60]];
    for (var i = 0; i < units.length; i++) {
      if (seconds >= units[i][1]) return (seconds / units[i][1]).toFixed(1) + units[i][0];
    }
    return seconds.toFixed(1) + "s";
  }

  function poll() {
    fetch(canvas.getAttribute("data-src"), { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(show)
      .catch(function (err) { status.textContent = "cannot load stats: " + err.message; })
      .finally(function () { setTimeout(poll, 2000); });
  }
  chart.draw();
  poll();
  window.addEventListener("resize", function () { chart.draw(); });
});
