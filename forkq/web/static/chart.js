// A small line chart on a <canvas>: time on x, one line per series, y from 0 to a round
// maximum. Written for the dashboard's two series (processed, failed per second); no
// dependencies, so the page works offline and under a strict Content-Security-Policy.
"use strict";

function RateChart(canvas, series) {
  this.canvas = canvas;
  this.series = series;          // [{name, color}]
  this.points = [];              // [{t: seconds, values: [..]}]
  this.maxPoints = 90;           // three minutes at one sample every two seconds
}

RateChart.prototype.push = function (t, values) {
  this.points.push({ t: t, values: values });
  if (this.points.length > this.maxPoints) this.points.shift();
  this.canvas.setAttribute("data-points", String(this.points.length));
  this.draw();
};

// 1, 2, 5, 10, 20, 50...: a y maximum a reader can scale in their head
RateChart.niceMax = function (value) {
  if (value <= 1) return 1;
  var base = Math.pow(10, Math.floor(Math.log10(value)));
  var steps = [1, 2, 5, 10];
  for (var i = 0; i < steps.length; i++) if (steps[i] * base >= value) return steps[i] * base;
  return 10 * base;
};

RateChart.prototype.draw = function () {
  var canvas = this.canvas, ratio = window.devicePixelRatio || 1;
  var width = canvas.clientWidth || canvas.width, height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) {   // sharp lines on high-DPI screens
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  var ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  var left = 56, right = 12, top = 10, bottom = 24;
  var plotW = width - left - right, plotH = height - top - bottom;

  var top_ = 0;
  this.points.forEach(function (p) { p.values.forEach(function (v) { top_ = Math.max(top_, v); }); });
  var ymax = RateChart.niceMax(top_);
  var style = getComputedStyle(canvas);
  ctx.font = "11px " + (style.fontFamily || "sans-serif");
  ctx.lineWidth = 1;

  // horizontal grid with labels
  for (var i = 0; i <= 4; i++) {
    var y = top + plotH - (plotH * i) / 4;
    ctx.strokeStyle = "#e3e6ea";
    ctx.beginPath(); ctx.moveTo(left, y + 0.5); ctx.lineTo(left + plotW, y + 0.5); ctx.stroke();
    ctx.fillStyle = "#6b7280";
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    var label = (ymax * i) / 4;
    ctx.fillText(label >= 10 ? Math.round(label).toLocaleString() : label.toFixed(label % 1 ? 2 : 0), left - 6, y);
  }
  if (this.points.length < 1) return;

  var t1 = this.points[this.points.length - 1].t;
  var t0 = Math.min(this.points[0].t, t1 - 60);       // at least a minute wide
  var x = function (t) { return left + (plotW * (t - t0)) / (t1 - t0 || 1); };
  var yOf = function (v) { return top + plotH - (plotH * v) / ymax; };

  // time labels: seconds before now
  ctx.textAlign = "center"; ctx.textBaseline = "top"; ctx.fillStyle = "#6b7280";
  var span = t1 - t0, step = span > 120 ? 60 : 30;
  for (var ago = 0; ago <= span; ago += step) {
    ctx.fillText(ago === 0 ? "now" : "-" + ago + "s", x(t1 - ago), top + plotH + 6);
  }

  var points = this.points;
  this.series.forEach(function (s, k) {
    ctx.strokeStyle = s.color; ctx.lineWidth = 2; ctx.lineJoin = "round";
    ctx.beginPath();
    points.forEach(function (p, n) {
      var px = x(p.t), py = yOf(p.values[k]);
      if (n === 0) ctx.moveTo(px, py); else ctx.lineTo(px, py);
    });
    ctx.stroke();
    if (points.length === 1) {   // one sample is a dot, not an invisible zero-length line
      ctx.fillStyle = s.color;
      ctx.beginPath(); ctx.arc(x(points[0].t), yOf(points[0].values[k]), 3, 0, 2 * Math.PI); ctx.fill();
    }
  });
};
