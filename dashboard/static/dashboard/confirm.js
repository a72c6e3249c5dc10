// A button with data-confirm="question" submits its form only once the operator says yes.
// A file rather than onclick="...": the Content-Security-Policy runs no inline script.
"use strict";
document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-confirm]");
  if (button && !window.confirm(button.dataset.confirm)) {
    event.preventDefault();
  }
});
