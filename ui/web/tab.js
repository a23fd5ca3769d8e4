// The tab's stored conversation. Its id is kept in sessionStorage, so a reloaded tab shows it again. A tab the
// browser duplicated starts with a copy of that storage, and would go on writing into the other tab's
// conversation: before a page resumes a stored id it asks the other open pages (a BroadcastChannel) whether one of
// them shows it, and starts a new chat if one does. A reload does not meet itself: the old page is gone.
(() => {
  const KEY = "localmoe-chat";
  const WAIT_MS = 250; // how long a page waits for another page's answer
  const me = Math.random().toString(36).slice(2) + Date.now().toString(36);
  const channel = "BroadcastChannel" in window ? new BroadcastChannel("localmoe-chat") : null;
  if (channel) {
    channel.onmessage = (e) => {
      const id = sessionStorage.getItem(KEY);
      if (e.data && e.data.ask && e.data.from !== me && id && e.data.ask === id) {
        channel.postMessage({ held: id, to: e.data.from });
      }
    };
  }

  // The id this page may resume: the stored one unless another open page shows it ("" for a new chat).
  async function recall() {
    const id = sessionStorage.getItem(KEY) || "";
    if (!id || !channel) return id;
    const held = await new Promise((resolve) => {
      const listen = (e) => {
        if (e.data && e.data.held === id && e.data.to === me) done(true);
      };
      const done = (answer) => {
        clearTimeout(timer);
        channel.removeEventListener("message", listen);
        resolve(answer);
      };
      const timer = setTimeout(() => done(false), WAIT_MS);
      channel.addEventListener("message", listen);
      channel.postMessage({ ask: id, from: me });
    });
    if (held) sessionStorage.removeItem(KEY);
    return held ? "" : id;
  }

  window.localmoeTab = { recall, remember: (id) => sessionStorage.setItem(KEY, id || "") };
})();
