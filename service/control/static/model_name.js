// A job's model as the dashboard names it: the preset; a Hugging Face model's
// architecture and config path; a factory's import path; a built-in Llama's dimensions.
// A classic script (app.js calls modelName); under Node it exports it for the tests.
"use strict";

function modelName(model) {
  if (typeof model === "string") return model;
  if (model.factory) return `factory ${model.factory}`;
  if (model.hf || model.hf_arch) {
    const arch = model.hf_arch || "Hugging Face";
    return model.hf ? `${arch} (${model.hf})` : arch;
  }
  return `Llama dim ${model.dim}, ${model.n_layers} layers, ${model.n_heads} heads ` +
    `(${model.n_kv_heads} kv), ffn ${model.ffn_dim}`;
}

if (typeof module !== "undefined") module.exports = { modelName };
