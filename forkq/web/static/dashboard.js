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
  var previous = null;

  function show(sample) {
    document.querySelectorAll("[data-stat]").forEach(function (el) {
      var value = sample[el.getAttribute("data-stat")];
      if (typeof value === "number") el.textContent = value.toLocaleString();
    });
    if (previous && sample.time > previous.time) {
      var dt = sample.time - previous.time;
      // counters can go down (someone reset the stats): show zero, not a negative rate
      var done = Math.max(0, sample.processed - previous.processed) / dt;
      var failed = Math.max(0, sample.failed - previous.failed) / dt;
      chart.push(sample.time, [done, failed]);
      status.textContent = done.toFixed(1) + " processed/s, " + failed.toFixed(1) + " failed/s";
    }
    previous = sample;
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
