// The page's side of localmoe.ui.web.stream: a typed message goes to the stream route, not through
// Gradio's queue, and the user's message and the answer's text are drawn into the chat pane as they come.
// Gradio keeps everything else: when the route says "sync" (a tool card, the approval card, an error) and when
// the answer is done, the hidden #stream-sync button has Gradio redraw the chat from the server's transcript,
// and the bubbles drawn here are removed once Gradio shows their messages. A message with an image, a page
// without its key yet, or `window.localmoeStream.enabled = false` goes through Gradio's own submit.
(() => {
  const PATH = "/localmoe/stream";
  const S = (window.localmoeStream = { enabled: true, busy: false, syncing: false, again: false });
  const q = (selector) => document.querySelector(selector);
  const drawn = new Map(); // transcript index -> bubble drawn here
  let unplaced = []; // bubbles drawn before the route gave their index (the user's message)

  const key = () => (q("#stream-key textarea") || q("#stream-key input") || {}).value || "";
  const pane = () => q("#chat .bubble-wrap");

  function box() {
    const wrap = pane();
    let b = document.getElementById("lm-stream");
    if (!b || b.parentNode !== wrap) {
      b = document.createElement("div");
      b.id = "lm-stream";
      wrap.appendChild(b);
    }
    return b;
  }

  function bubble(role, title, text) {
    const row = document.createElement("div");
    row.className = "lm-row lm-" + role;
    const body = document.createElement("div");
    body.className = "lm-text";
    body.dataset.testid = role === "user" ? "user" : "bot";
    if (title) {
      const details = document.createElement("details");
      details.open = true;
      const summary = document.createElement("summary");
      summary.textContent = title;
      details.append(summary, body);
      row.appendChild(details);
    } else {
      row.appendChild(body);
    }
    row.lmBody = body;
    row.lmRole = role;
    write(row, text);
    box().appendChild(row);
    scroll();
    return row;
  }

  function write(row, text) {
    row.lmBody.textContent = text;
    row.lmBody.setAttribute("aria-label", (row.lmRole === "user" ? "user's message: " : "bot's message: ") + text);
  }

  function scroll() {
    const wrap = pane();
    if (wrap) wrap.scrollTop = wrap.scrollHeight;
  }

  const SYNC_LOST = 15000; // ms: a redraw whose follow-up never came (an event Gradio dropped) is asked again
  function sync() {
    if (S.syncing && performance.now() - S.syncStarted < SYNC_LOST) {
      S.again = true;
      return;
    }
    S.syncStarted = performance.now();
    const button = q("#stream-sync");
    if (!button) return;
    S.syncing = true;
    // after the answer, Gradio's redraw replaces every bubble drawn here; a new message starts a clean slate
    if (!S.busy) S.replaced = [...(S.replaced || []), ...drawn.values(), ...unplaced];
    if (!S.busy) {
      drawn.clear();
      unplaced = [];
    }
    button.click();
  }

  // Gradio's chat now shows `count` messages (the sync event's follow-up): drop the bubbles it replaced.
  S.synced = (count) => {
    requestAnimationFrame(() => {
      if (S.replaced) S.replaced.forEach((row) => row.remove());
      else
        for (const [i, row] of drawn)
          if (i < count) {
            row.remove();
            drawn.delete(i);
          }
      S.replaced = null;
      S.syncing = false;
      if (S.again) {
        S.again = false;
        sync();
      }
    });
  };

  function apply(op) {
    if (op.op === "new") {
      const waiting = op.role === "user" ? unplaced.shift() : undefined;
      const row = waiting || bubble(op.role, op.title, op.text);
      if (waiting) write(row, op.text);
      drawn.set(op.i, row);
    } else if (op.op === "append") {
      const row = drawn.get(op.i);
      if (!row) return sync(); // Gradio already shows this message: it redraws it
      write(row, row.lmBody.textContent + op.text);
      scroll();
    } else if (op.op === "sync") {
      sync();
    }
  }

  let notes = []; // errors of the route itself: shown until the next message
  function note(text) {
    notes.push(bubble("assistant", "Error", text));
  }

  async function send(textarea, text) {
    S.busy = true;
    S.sentAt = performance.now();
    notes.forEach((row) => row.remove());
    notes = [];
    unplaced.push(bubble("user", null, text));
    textarea.value = "";
    textarea.dispatchEvent(new Event("input", { bubbles: true }));
    try {
      const response = await fetch(PATH, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ key: key(), text }),
      });
      if (!response.ok) {
        let message = response.status + " " + response.statusText;
        try {
          message = (await response.json()).error.message;
        } catch (e) {}
        note(message);
        textarea.value = text; // not sent: the message stays in the box
        textarea.dispatchEvent(new Event("input", { bubbles: true }));
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
          apply(JSON.parse(buffer.slice(0, end)));
          buffer = buffer.slice(end + 1);
        }
      }
    } catch (e) {
      note(String(e));
    } finally {
      S.busy = false;
      sync(); // Gradio's chat takes over what was drawn here
    }
  }

  function takes(textarea) {
    const text = textarea.value;
    return S.enabled && !S.busy && key() && text.trim() && pane() && q("#stream-sync") && !q("#image img");
  }

  document.addEventListener(
    "keydown",
    (event) => {
      if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
      const textarea = event.target;
      if (!(textarea instanceof HTMLTextAreaElement) || !textarea.closest("#message") || !takes(textarea)) return;
      event.preventDefault();
      event.stopImmediatePropagation();
      send(textarea, textarea.value);
    },
    true,
  );
  document.addEventListener(
    "click",
    (event) => {
      const textarea = q("#message textarea");
      if (!event.target.closest || !event.target.closest("#send") || !textarea || !takes(textarea)) return;
      event.preventDefault();
      event.stopImmediatePropagation();
      send(textarea, textarea.value);
    },
    true,
  );
})();
