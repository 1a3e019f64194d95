//! A JSON schema made ready for llguidance the way llama.cpp's converter and the servers that
//! compile schemas read one (llama-server, vLLM's xgrammar, OpenAI's strict mode):
//!
//! - an object that lists `properties` and says nothing of other keys is closed to them
//!   (`additionalProperties: false`): a schema names the keys it wants, and an open object lets a
//!   model add keys until it runs out of tokens. Where keys come from several places, the parts
//!   stay open (each names only some of the keys the whole allows): the branches of an `allOf`,
//!   an object whose `properties` sit beside an `allOf`, `anyOf`, `oneOf` or `$ref` and that
//!   combinator's branches (a union that shares a field), and the `$defs` an `allOf` refers to
//!   (a base schema extended). Before that, an `allOf` whose parts are plain objects (properties,
//!   required; a part may be a `$ref` to one) is merged into its object, as llama.cpp's converter
//!   merges it, so the whole is closed to keys no part lists, and the properties of a plain object
//!   beside an `anyOf`/`oneOf` of plain objects (a union sharing a field) are merged into each
//!   branch;
//! - llguidance's options default to what those converters do: compact separators with no free
//!   whitespace, `oneOf` read as `anyOf` (`coerce_one_of`), and keywords and formats it does not
//!   implement ignored rather than refused (`lenient`: `uniqueItems`, `format: "password"`).
//!   A schema's own `x-guidance` entry overrides each of them.
//!
//! ```
//! use lloyal_core::grammar::schema::prepare;
//! use serde_json::json;
//! let s = prepare(json!({"type": "object", "properties": {"a": {"type": "integer"}}}));
//! assert_eq!(s["additionalProperties"], json!(false));
//! assert_eq!(s["x-guidance"]["lenient"], json!(true));
//! ```

use serde_json::{json, Map, Value};

/// Keys of a schema object that say which keys beyond `properties` an object may have.
const OTHER_KEYS: [&str; 3] = ["additionalProperties", "patternProperties", "unevaluatedProperties"];

/// Keywords whose value is one subschema.
const ONE: [&str; 8] =
    ["additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames"];

/// Keywords whose value is a list of subschemas (`items` of old drafts).
const LIST: [&str; 4] = ["anyOf", "oneOf", "prefixItems", "items"];

/// Keywords whose value maps names to subschemas.
const MAP: [&str; 4] = ["properties", "patternProperties", "$defs", "definitions"];

/// Keywords that combine subschemas (keys may come from each).
const COMBINE: [&str; 3] = ["allOf", "anyOf", "oneOf"];

/// `schema` made ready for llguidance (see the module).
pub fn prepare(mut schema: Value) -> Value {
    let defs = definitions(&schema);
    merge_parts(&mut schema, &defs, 0);
    let mut extended = Vec::new();
    extended_refs(&schema, &mut extended);
    close_objects(&mut schema, false, &extended);
    if let Some(obj) = schema.as_object_mut() {
        let options = obj.entry("x-guidance").or_insert_with(|| json!({}));
        if let Some(options) = options.as_object_mut() {
            for (key, value) in [("whitespace_flexible", false), ("coerce_one_of", true), ("lenient", true)] {
                options.entry(key).or_insert(Value::Bool(value));
            }
        }
    }
    schema
}

/// Keys a plain object part of an `allOf` may have (besides `type: "object"`).
const PLAIN: [&str; 6] = ["type", "properties", "required", "title", "description", "$comment"];

/// How deep `allOf`s are merged inside each other (a base extending a base...).
const MERGE_DEPTH: usize = 16;

/// The root's `$defs` and `definitions`, by the `$ref` that names each.
fn definitions(schema: &Value) -> Map<String, Value> {
    let mut out = Map::new();
    for key in ["$defs", "definitions"] {
        if let Some(Value::Object(defs)) = schema.get(key) {
            for (name, def) in defs {
                out.insert(format!("#/{key}/{name}"), def.clone());
            }
        }
    }
    out
}

/// Merge into each object of `schema` an `allOf` whose parts are all plain objects (a `$ref`
/// to one counts), their own `allOf`s merged first: one object with every part's properties
/// (a property two parts give becomes the `allOf` of both) and required keys. Then a plain
/// object with an `anyOf` or `oneOf` of plain objects beside its properties (a union sharing a
/// field) becomes the union of its own keys merged into each branch.
fn merge_parts(schema: &mut Value, defs: &Map<String, Value>, depth: usize) {
    let Some(obj) = schema.as_object_mut() else { return };
    obj.values_mut().for_each(|v| match v {
        Value::Array(items) => items.iter_mut().for_each(|v| merge_parts(v, defs, depth)),
        v => merge_parts(v, defs, depth),
    });
    let object = obj.get("type").is_none_or(|t| t == "object");
    if let (true, Some(parts)) = (object, plain_parts(obj.get("allOf"), defs, depth)) {
        obj.remove("allOf");
        obj.insert("type".into(), json!("object"));
        parts.iter().for_each(|part| merge_into(obj, part));
    }
    for key in ["anyOf", "oneOf"] {
        // its own keys: plain ones, the union, and definitions or options that stay where they are
        let own_keys_plain = obj.keys().all(|k| {
            k == key
                || PLAIN.contains(&k.as_str())
                || k == "x-guidance"
                || (k.starts_with('$') && k != "$ref")
        });
        if !object || !obj.contains_key("properties") || !own_keys_plain {
            continue;
        }
        let Some(branches) = plain_parts(obj.get(key), defs, depth) else { continue };
        let mut own = Map::new();
        for k in ["properties", "required"] {
            if let Some(v) = obj.remove(k) {
                own.insert(k.into(), v);
            }
        }
        let merged: Vec<Value> = branches
            .iter()
            .map(|branch| {
                let mut whole = own.clone();
                whole.insert("type".into(), json!("object"));
                merge_into(&mut whole, branch);
                Value::Object(whole)
            })
            .collect();
        obj.insert(key.into(), Value::Array(merged));
    }
}

/// The parts of a combinator list (`list`), each a plain object (a `$ref` to one resolved, its
/// own `allOf`s merged), or `None` if one is not.
fn plain_parts(list: Option<&Value>, defs: &Map<String, Value>, depth: usize) -> Option<Vec<Value>> {
    let Some(Value::Array(parts)) = list else { return None };
    let mut plain = Vec::new();
    for part in parts {
        let mut part = match part.get("$ref").and_then(Value::as_str) {
            Some(r) if part.as_object().is_some_and(|o| o.len() == 1) => defs.get(r)?.clone(),
            _ => part.clone(),
        };
        if depth < MERGE_DEPTH {
            merge_parts(&mut part, defs, depth + 1);
        }
        let o = part.as_object()?;
        let is_object = o.get("type").is_none_or(|t| t == "object");
        if !is_object || !o.keys().all(|k| PLAIN.contains(&k.as_str())) {
            return None;
        }
        plain.push(part);
    }
    Some(plain)
}

/// `part`'s properties and required keys added to `obj`'s.
fn merge_into(obj: &mut Map<String, Value>, part: &Value) {
    if let Some(Value::Object(props)) = part.get("properties") {
        let mine = obj.entry("properties").or_insert_with(|| json!({}));
        if let Some(mine) = mine.as_object_mut() {
            for (name, sub) in props {
                match mine.get_mut(name) {
                    Some(have) if have != sub => *have = json!({"allOf": [have.clone(), sub.clone()]}),
                    Some(_) => {}
                    None => {
                        mine.insert(name.clone(), sub.clone());
                    }
                }
            }
        }
    }
    if let Some(Value::Array(req)) = part.get("required") {
        let mine = obj.entry("required").or_insert_with(|| json!([]));
        if let Some(mine) = mine.as_array_mut() {
            for r in req {
                if !mine.contains(r) {
                    mine.push(r.clone());
                }
            }
        }
    }
}

/// Whether `obj` lists properties beside something else that may add keys (a combinator or a
/// `$ref`).
fn shares_keys(obj: &Map<String, Value>) -> bool {
    obj.contains_key("properties")
        && (obj.contains_key("$ref") || COMBINE.iter().any(|k| obj.contains_key(*k)))
}

/// Into `out`, the `$ref`s that extend or are extended: those of an `allOf`'s branches, and of
/// the combinators' branches of an object that [`shares_keys`].
fn extended_refs(schema: &Value, out: &mut Vec<String>) {
    match schema {
        Value::Object(obj) => {
            let shares = shares_keys(obj);
            for key in COMBINE {
                if let Some(Value::Array(subs)) = obj.get(key) {
                    for sub in subs.iter().filter(|_| key == "allOf" || shares) {
                        if let Some(Value::String(r)) = sub.get("$ref") {
                            out.push(r.clone());
                        }
                    }
                }
            }
            obj.values().for_each(|v| extended_refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| extended_refs(v, out)),
        _ => {}
    }
}

/// Close every object of `schema` that lists properties and says nothing of other keys, but
/// not one that is part of a whole (`part`: a branch of an `allOf`, or of a combinator beside
/// properties), nor one that [`shares_keys`], nor a `$defs` entry `extended` names.
fn close_objects(schema: &mut Value, part: bool, extended: &[String]) {
    let Some(obj) = schema.as_object_mut() else { return };
    let shares = shares_keys(obj);
    if !part && !shares && obj.contains_key("properties") && !OTHER_KEYS.iter().any(|k| obj.contains_key(*k))
    {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ONE {
        if let Some(sub) = obj.get_mut(key) {
            close_objects(sub, false, extended);
        }
    }
    for key in LIST {
        each(obj, key, |sub| close_objects(sub, shares && key != "prefixItems" && key != "items", extended));
    }
    each(obj, "allOf", |sub| close_objects(sub, true, extended));
    for key in MAP {
        if let Some(Value::Object(subs)) = obj.get_mut(key) {
            for (name, sub) in subs.iter_mut() {
                let named = format!("#/{key}/{name}");
                let part = (key == "$defs" || key == "definitions") && extended.contains(&named);
                close_objects(sub, part, extended);
            }
        }
    }
}

/// Run `f` on each subschema of the list under `key`.
fn each(obj: &mut Map<String, Value>, key: &str, f: impl Fn(&mut Value)) {
    if let Some(Value::Array(subs)) = obj.get_mut(key) {
        subs.iter_mut().for_each(f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_with_properties_are_closed_wherever_they_are_but_in_an_all_of() {
        let s = prepare(json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                "list": {"type": "array", "items": {"properties": {"c": {}}}},
                "open": {"type": "object"},
                "said": {"properties": {"d": {}}, "additionalProperties": {"properties": {"e": {}}}},
                "pattern": {"properties": {"f": {}}, "patternProperties": {"^x": {}}},
                "either": {"anyOf": [{"properties": {"g": {}}}, {"$ref": "#/$defs/node"}]},
                "both": {"allOf": [{"properties": {"h": {}}}, {"properties": {"i": {}}}]}
            },
            "$defs": {"node": {"properties": {"next": {"$ref": "#/$defs/node"}}}}
        }));
        let closed = |v: &Value| v.get("additionalProperties") == Some(&json!(false));
        let p = &s["properties"];
        assert!(closed(&s) && closed(&p["a"]) && closed(&p["list"]["items"]));
        assert!(closed(&s["$defs"]["node"]) && closed(&p["either"]["anyOf"][0]), "alternatives are whole");
        assert!(!closed(&p["open"]), "no properties listed: any object");
        assert_eq!(
            p["said"]["additionalProperties"]["additionalProperties"],
            json!(false),
            "said, and inside"
        );
        assert!(!closed(&p["pattern"]), "patternProperties say which other keys");
        let both = &p["both"]["allOf"];
        assert!(!closed(&both[0]) && !closed(&both[1]), "an allOf's parts stay open");
    }

    /// Keys from several places: a field shared by a union's branches, a base extended through
    /// `allOf` and `$ref`, properties beside an `allOf` (the review's three schemas llguidance
    /// found unsatisfiable when the parts were closed); the objects inside the parts are closed.
    #[test]
    fn the_parts_of_a_whole_stay_open() {
        let closed = |v: &Value| v.get("additionalProperties") == Some(&json!(false));
        let union = prepare(json!({
            "type": "object",
            "properties": {"kind": {"type": "string"}},
            "required": ["kind"],
            "anyOf": [
                {"properties": {"a": {"type": "object", "properties": {"x": {}}}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
            ]
        }));
        // the shared field merged into each branch, each branch whole
        assert!(
            union.get("properties").is_none() && closed(&union["anyOf"][0]) && closed(&union["anyOf"][1])
        );
        assert_eq!(union["anyOf"][0]["required"], json!(["kind", "a"]));
        assert!(union["anyOf"][1]["properties"]["kind"].is_object());
        assert!(closed(&union["anyOf"][0]["properties"]["a"]), "an object inside a branch is whole");
        // a branch that is more than keys: left as it was, open
        let mixed = prepare(json!({
            "properties": {"kind": {}},
            "anyOf": [{"properties": {"a": {}}}, {"not": {"required": ["b"]}}]
        }));
        assert!(!closed(&mixed) && !closed(&mixed["anyOf"][0]));
        // plain parts are merged, then the whole is closed
        let extended = prepare(json!({
            "$defs": {
                "base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
                "leaf": {"type": "object", "properties": {"v": {}}}
            },
            "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"name": {"type": "string"}, "id": {"minimum": 1}}}],
            "properties": {"leaf": {"$ref": "#/$defs/leaf"}}
        }));
        assert!(extended.get("allOf").is_none() && closed(&extended));
        assert_eq!(extended["required"], json!(["id"]));
        let props = &extended["properties"];
        assert_eq!(props["id"], json!({"allOf": [{"type": "integer"}, {"minimum": 1}]}), "both parts' id");
        assert!(props["name"].is_object() && props["leaf"].is_object());
        assert!(closed(&extended["$defs"]["leaf"]) && closed(&extended["$defs"]["base"]));
        let beside = prepare(json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "allOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]
        }));
        assert!(closed(&beside) && beside["properties"]["b"].is_object());
        // a part that is more than an object's keys: not merged, the parts and the base stay open
        let conditional = prepare(json!({
            "$defs": {"base": {"properties": {"id": {}}}},
            "properties": {"a": {}},
            "allOf": [{"$ref": "#/$defs/base"}, {"if": {"required": ["a"]}, "then": {"required": ["id"]}}]
        }));
        assert!(conditional.get("allOf").is_some() && !closed(&conditional));
        assert!(!closed(&conditional["$defs"]["base"]), "a base an allOf extends");
    }

    #[test]
    fn the_options_default_to_llama_cpps_reading_and_the_schema_overrides_each() {
        let s = prepare(json!({"type": "string"}));
        assert_eq!(
            s["x-guidance"],
            json!({"whitespace_flexible": false, "coerce_one_of": true, "lenient": true})
        );
        let s =
            prepare(json!({"type": "string", "x-guidance": {"lenient": false, "whitespace_flexible": true}}));
        assert_eq!(
            s["x-guidance"],
            json!({"whitespace_flexible": true, "coerce_one_of": true, "lenient": false})
        );
        assert_eq!(prepare(json!(true)), json!(true), "a boolean schema is left as it is");
    }
}
