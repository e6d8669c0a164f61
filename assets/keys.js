() => {
  // Enter sends, Shift+Enter adds a line, in the chat box and the Compare prompt. Gradio's multi-line
  // textbox does the opposite (Shift+Enter submits), so we take the key first, in the capture phase.
  const send = {"message": "send", "compare-prompt": "compare-run"};
  const handle = (e) => {
    if (e.key !== "Enter" || e.isComposing || e.target.tagName !== "TEXTAREA") return;
    const box = Object.keys(send).find((id) => e.target.closest("#" + id));
    if (!box) return;
    e.stopImmediatePropagation();  // keep Gradio's own Enter handling out of it
    if (e.shiftKey) return;  // the browser's default: a new line
    e.preventDefault();
    if (e.type === "keydown") {
      e.target.dispatchEvent(new Event("input", {bubbles: true}));  // the latest text reaches Gradio
      const btn = document.getElementById(send[box]);
      if (btn) setTimeout(() => btn.click(), 0);
    }
  };
  document.addEventListener("keydown", handle, true);
  document.addEventListener("keypress", handle, true);
}
