// mjsched dashboard: live updates over server-sent events, paused while the tab is hidden, and times
// shown in the viewer's zone. No library, no build step.
"use strict";
(function () {
  var source = null;
  var pending = false;

  function localize(root) {
    var nodes = root.querySelectorAll("time.viewer");
    for (var i = 0; i < nodes.length; i++) {
      var when = new Date(nodes[i].getAttribute("datetime"));
      if (!isNaN(when)) {
        nodes[i].textContent = when.toLocaleString(undefined, {dateStyle: "medium", timeStyle: "medium"});
        nodes[i].title = Intl.DateTimeFormat().resolvedOptions().timeZone;
      }
    }
  }

  function editing() {
    var active = document.activeElement;
    return active && active.form && active.form.method === "post" && active.tagName !== "BUTTON";
  }

  function refresh() {
    if (document.hidden) { pending = true; return; }
    if (editing()) { pending = true; return; }
    pending = false;
    fetch(window.location.href, {headers: {"Accept": "text/html"}, credentials: "same-origin"})
      .then(function (response) {
        if (response.redirected || !response.ok) { return null; }
        return response.text();
      })
      .then(function (html) {
        if (!html) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("main");
        var main = document.getElementById("main");
        if (fresh && main) {
          var flashes = main.querySelectorAll(".flash");
          main.innerHTML = fresh.innerHTML;
          for (var i = flashes.length - 1; i >= 0; i--) {
            if (!main.querySelector(".flash")) { main.insertBefore(flashes[i], main.firstChild); }
          }
          localize(main);
          document.body.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () { pending = true; });
  }

  function setLive(on) {
    var dot = document.getElementById("live");
    if (dot) { dot.className = on ? "live on" : "live"; }
    document.body.setAttribute("data-live", on ? "on" : "off");
  }

  function connect() {
    if (source || !window.EventSource) { return; }
    source = new EventSource("/api/events");
    source.addEventListener("open", function () { setLive(true); });
    source.addEventListener("change", refresh);
    source.addEventListener("error", function () { setLive(false); });
  }

  function disconnect() {
    if (source) { source.close(); source = null; }
    setLive(false);
  }

  document.addEventListener("visibilitychange", function () {
    if (document.hidden) {
      disconnect();
    } else {
      connect();
      refresh();
    }
  });
  document.addEventListener("focusout", function () { if (pending) { window.setTimeout(refresh, 0); } });
  document.addEventListener("DOMContentLoaded", function () {
    localize(document);
    if (!document.hidden && document.getElementById("main") && !document.querySelector("form.login")) {
      connect();
    }
  });
})();
