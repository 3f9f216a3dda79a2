// Forms built from a JSON Schema (the one the API validates with, from
// /api/jobs/schema). Values are checked against the same bounds before
// sending; errors from the API (`param: "params.<field>"`) land next to the
// field they name.
import { h, replace, safeId } from './dom.js';

const VISIBLE_OPTIONAL = 6; // optional fields shown before "More options"

export function humanize(name) {
  const text = name.replace(/_/g, ' ');
  return text.charAt(0).toUpperCase() + text.slice(1);
}

// The non-null branch of `X | None`, and whether null is allowed.
function unwrap(prop) {
  if (Array.isArray(prop.anyOf)) {
    const nonNull = prop.anyOf.filter((p) => p.type !== 'null');
    if (nonNull.length === 1) return { ...nonNull[0], default: prop.default, description: prop.description, nullable: true };
  }
  return { ...prop, nullable: false };
}

function kindOf(spec) {
  if (Array.isArray(spec.enum)) return 'enum';
  if (spec.type === 'boolean') return 'boolean';
  if (spec.type === 'integer' || spec.type === 'number') return spec.type;
  if (spec.type === 'array' && spec.items?.type === 'string') return 'list';
  if (spec.type === 'string') return 'string';
  return 'json'; // anything richer is edited as JSON text
}

function rangeHint(spec) {
  const lo = spec.minimum ?? spec.exclusiveMinimum;
  const hi = spec.maximum ?? spec.exclusiveMaximum;
  if (lo === undefined && hi === undefined) return '';
  const left = lo === undefined ? '' : `${spec.exclusiveMinimum !== undefined ? '>' : '≥'} ${lo}`;
  const right = hi === undefined ? '' : `${spec.exclusiveMaximum !== undefined ? '<' : '≤'} ${hi}`;
  return [left, right].filter(Boolean).join(', ');
}

// Help when neither the hints nor the schema say anything: the default.
function defaultHint(spec, required) {
  if (required) return 'Required.';
  if (spec.default === null || spec.default === undefined) return 'Optional; leave empty for the automatic choice.';
  if (typeof spec.default === 'boolean') return `Default: ${spec.default ? 'on' : 'off'}.`;
  if (Array.isArray(spec.default)) return spec.default.length ? `Default: ${spec.default.join(', ')}.` : 'Optional.';
  return `Default: ${typeof spec.default === 'object' ? JSON.stringify(spec.default) : spec.default}.`;
}

class Field {
  constructor(formId, name, prop, required, hint, { label, noneLabel } = {}) {
    this.name = name;
    this.spec = unwrap(prop);
    this.kind = kindOf(this.spec);
    this.required = required;
    const id = safeId(formId, name);
    this.id = id;
    this.noneLabel = noneLabel;
    this.errorEl = h('p', { class: 'field-error', id: `${id}-error`, 'aria-live': 'polite' });
    this.input = this.makeInput(id);
    this.input.setAttribute('aria-describedby', `${id}-error ${id}-help`);
    const helpText = [hint ?? this.spec.description ?? defaultHint(this.spec, required), rangeHint(this.spec)].filter(Boolean).join(' · ');
    const help = h('p', { class: 'field-help', id: `${id}-help`, text: helpText });
    const labelEl = h('label', { for: id }, label ?? humanize(name), required ? h('span', { class: 'req', 'aria-hidden': 'true', text: ' *' }) : null);
    this.el = this.kind === 'boolean'
      ? h('div', { class: 'field check', dataset: { field: name } }, h('div', { class: 'check-row' }, this.input, labelEl), help, this.errorEl)
      : h('div', { class: 'field', dataset: { field: name } }, labelEl, this.input, help, this.errorEl);
  }

  makeInput(id) {
    const { spec } = this;
    const dflt = spec.default;
    switch (this.kind) {
      case 'enum': {
        const options = [];
        if (!this.required && (dflt === undefined || dflt === null)) options.push(h('option', { value: '', text: this.noneLabel ?? 'automatic' }));
        for (const v of spec.enum) options.push(h('option', { value: String(v), text: String(v), selected: v === dflt }));
        return h('select', { id, name: this.name }, options);
      }
      case 'boolean':
        return h('input', { id, name: this.name, type: 'checkbox', checked: Boolean(dflt) });
      case 'integer':
      case 'number':
        return h('input', {
          id, name: this.name, type: 'number', step: this.kind === 'integer' ? '1' : 'any',
          value: dflt ?? '', placeholder: dflt === null ? 'automatic' : '',
        });
      case 'list':
        return h('textarea', { id, name: this.name, rows: 2, placeholder: 'one per line', value: (dflt || []).join('\n') });
      case 'json':
        // No default (or null, "none"): empty, never the text "null".
        return h('textarea', { id, name: this.name, rows: 3, class: 'mono', value: dflt === undefined || dflt === null ? '' : JSON.stringify(dflt) });
      default:
        return h('input', {
          id, name: this.name, type: 'text', value: dflt ?? '', autocomplete: 'off', spellcheck: false,
          placeholder: dflt === null ? 'automatic' : '', maxLength: spec.maxLength,
        });
    }
  }

  // {value} to send, {omit: true} to let the server default it, or {error}.
  read() {
    const { spec, input } = this;
    if (this.kind === 'boolean') return { value: input.checked };
    if (this.kind === 'number' || this.kind === 'integer') {
      if (input.validity.badInput) return { error: 'enter a number' };
    }
    const raw = input.value.trim();
    if (raw === '') {
      if (this.required) return { error: 'required' };
      return { omit: true };
    }
    switch (this.kind) {
      case 'integer':
      case 'number': {
        const n = Number(raw);
        if (!isFinite(n)) return { error: 'enter a number' };
        if (this.kind === 'integer' && !Number.isInteger(n)) return { error: 'must be a whole number' };
        if (spec.minimum !== undefined && n < spec.minimum) return { error: `must be ≥ ${spec.minimum}` };
        if (spec.maximum !== undefined && n > spec.maximum) return { error: `must be ≤ ${spec.maximum}` };
        if (spec.exclusiveMinimum !== undefined && n <= spec.exclusiveMinimum) return { error: `must be > ${spec.exclusiveMinimum}` };
        if (spec.exclusiveMaximum !== undefined && n >= spec.exclusiveMaximum) return { error: `must be < ${spec.exclusiveMaximum}` };
        return { value: n };
      }
      case 'list':
        return { value: raw.split('\n').map((s) => s.trim()).filter(Boolean) };
      case 'json':
        try {
          return { value: JSON.parse(raw) };
        } catch {
          return { error: 'must be valid JSON' };
        }
      case 'enum':
        return { value: spec.enum.find((v) => String(v) === raw) ?? raw };
      default:
        if (spec.maxLength !== undefined && raw.length > spec.maxLength) return { error: `at most ${spec.maxLength} characters` };
        if (spec.minLength !== undefined && raw.length < spec.minLength) return { error: `at least ${spec.minLength} characters` };
        if (spec.pattern && !new RegExp(spec.pattern, 'u').test(raw)) return { error: 'has an invalid format' };
        return { value: raw };
    }
  }

  setError(message) {
    this.errorEl.textContent = message || '';
    this.el.classList.toggle('invalid', Boolean(message));
    if (message) this.input.setAttribute('aria-invalid', 'true');
    else this.input.removeAttribute('aria-invalid');
  }

  // Choices offered while typing (a datalist): [{value, label}]. Free text stays possible.
  setSuggestions(items) {
    if (this.kind !== 'string') return;
    const listId = `${this.id}-choices`;
    this.datalist ??= h('datalist', { id: listId });
    if (!this.datalist.isConnected) this.input.after(this.datalist);
    this.input.setAttribute('list', listId);
    const seen = new Set();
    replace(this.datalist, items.filter((it) => !seen.has(it.value) && seen.add(it.value))
      .map((it) => h('option', { value: it.value, label: it.label || null })));
  }

  // A fixed list of choices ([{value, label}]) in a select, in place of the
  // text input; an empty value sends nothing, as an empty text field does.
  setOptions(items, help) {
    const select = h('select', { id: this.id, name: this.name, 'aria-describedby': this.input.getAttribute('aria-describedby') },
      items.map((it) => h('option', { value: it.value, text: it.label })));
    this.input.replaceWith(select);
    this.input = select;
    if (help) this.el.querySelector('.field-help').textContent = help;
  }

  setValue(value) {
    if (this.kind === 'boolean') this.input.checked = Boolean(value);
    else this.input.value = value ?? '';
  }
}

// A form for one object schema. `hints` adds help text per field; `extra`
// fields (e.g. priority) are validated the same way and returned apart.
export class SchemaForm {
  constructor(id, schema, { hints = {}, labels = {}, noneLabels = {}, prepend = [], extra = {}, submitLabel = 'Submit' } = {}) {
    this.id = id;
    const required = new Set(schema.required || []);
    const entries = Object.entries(schema.properties || {});
    // Required fields first, then the rest in the schema's order.
    entries.sort(([a], [b]) => Number(required.has(b)) - Number(required.has(a)));
    this.fields = entries.map(([name, prop]) => new Field(id, name, prop, required.has(name), hints[name],
      { label: labels[name], noneLabel: noneLabels[name] }));
    this.extraFields = Object.entries(extra).map(([name, prop]) => new Field(id, name, prop, false, prop.description, { label: labels[name] }));
    this.formError = h('div', { class: 'form-error', role: 'alert' });
    this.submit = h('button', { type: 'submit', class: 'primary', text: submitLabel });
    const visible = [];
    const more = [];
    let optional = 0;
    for (const f of this.fields) {
      if (f.required || optional++ < VISIBLE_OPTIONAL) visible.push(f.el);
      else more.push(f.el);
    }
    more.push(...this.extraFields.map((f) => f.el));
    this.moreEl = more.length ? h('details', { class: 'more' }, h('summary', { text: 'More options' }), h('div', { class: 'grid' }, more)) : null;
    this.el = h('form', { class: 'schema-form', id, novalidate: true },
      prepend, h('div', { class: 'grid' }, visible), this.moreEl, this.formError,
      h('div', { class: 'actions' }, this.submit));
  }

  field(name) {
    return this.fields.find((f) => f.name === name) || this.extraFields.find((f) => f.name === name);
  }

  // {params, extra} or null when a field is invalid (errors shown).
  read() {
    this.clearErrors();
    const params = {};
    const extra = {};
    let ok = true;
    for (const [fields, out] of [[this.fields, params], [this.extraFields, extra]]) {
      for (const f of fields) {
        const r = f.read();
        if (r.error) { f.setError(r.error); ok = false; } else if (!r.omit) out[f.name] = r.value;
      }
    }
    if (!ok) this.focusFirstError();
    return ok ? { params, extra } : null;
  }

  clearErrors() {
    for (const f of [...this.fields, ...this.extraFields]) f.setError('');
    this.formError.textContent = '';
  }

  // Place an API error next to the field its `param` names, else above the button.
  showApiError(err, prefix = 'params.') {
    const param = err.param || '';
    const name = param.startsWith(prefix) ? param.slice(prefix.length).split(/[.[]/)[0] : param;
    const f = name && this.field(name);
    if (f) {
      f.setError(err.message);
      this.focusFirstError();
    } else {
      this.formError.textContent = err.message;
    }
  }

  focusFirstError() {
    const bad = [...this.fields, ...this.extraFields].find((f) => f.el.classList.contains('invalid'));
    if (!bad) return;
    if (this.moreEl && this.moreEl.contains(bad.el)) this.moreEl.open = true;
    bad.input.focus();
  }

  busy(on, label) {
    this.submit.disabled = on;
    if (label) this.submit.textContent = label;
  }
}
