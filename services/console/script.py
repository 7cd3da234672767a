"""The console's only script: it renews each page's live region without a reload.

Every ``every`` ms it fetches the region's own URL with ``fragment=1`` (server-rendered
HTML) and swaps it in; it waits while the tab is hidden, keeps the last good region when
a fetch fails (and says so in the header), and never overlaps two fetches.
"""

CONSOLE_JS = r"""
(function () {
  const live = document.getElementById("live");
  const stamp = document.getElementById("stamp");
  if (!live) return;
  const every = Number(live.dataset.every) || 2000;
  let busy = false;
  async function renew() {
    if (busy || document.hidden) return;
    busy = true;
    try {
      const reply = await fetch(live.dataset.live, {headers: {"Accept": "text/html"}});
      if (!reply.ok && reply.status !== 404) throw new Error("HTTP " + reply.status);
      live.innerHTML = await reply.text();
      stamp.textContent = "updated " + new Date().toLocaleTimeString();
      stamp.dataset.renewals = String(Number(stamp.dataset.renewals || 0) + 1);
    } catch (err) {
      stamp.textContent = "console unreachable (" + err.message + "); retrying";
    } finally {
      busy = false;
    }
  }
  setInterval(renew, every);
  document.addEventListener("visibilitychange", renew);
})();
"""
