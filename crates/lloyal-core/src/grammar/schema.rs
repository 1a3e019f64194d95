//! A JSON schema made ready for llguidance the way llama.cpp's converter and the servers that
//! compile schemas read one (llama-server, vLLM's xgrammar, OpenAI's strict mode):
//!
//! - an object that lists `properties` and says nothing of other keys is closed to them
//!   (`additionalProperties: false`): a schema names the keys it wants, and an open object lets a
//!   model add keys until it runs out of tokens. Branches of an `allOf` stay open (each
//!   names only part of the keys the whole allows);
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

/// `schema` made ready for llguidance (see the module).
pub fn prepare(mut schema: Value) -> Value {
    close_objects(&mut schema, false);
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

/// Close every object of `schema` that lists properties and says nothing of other keys, but
/// not the branches of an `allOf` (`in_all_of`).
fn close_objects(schema: &mut Value, in_all_of: bool) {
    let Some(obj) = schema.as_object_mut() else { return };
    if !in_all_of && obj.contains_key("properties") && !OTHER_KEYS.iter().any(|k| obj.contains_key(*k)) {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ONE {
        if let Some(sub) = obj.get_mut(key) {
            close_objects(sub, false);
        }
    }
    for key in LIST {
        each(obj, key, |sub| close_objects(sub, false));
    }
    each(obj, "allOf", |sub| close_objects(sub, true));
    for key in MAP {
        if let Some(Value::Object(subs)) = obj.get_mut(key) {
            subs.values_mut().for_each(|sub| close_objects(sub, false));
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
                "pattern": {"properties": {"f": {}}, "patternProperties": {"^x": {}}}
            },
            "$defs": {"node": {"properties": {"next": {"$ref": "#/$defs/node"}}}},
            "anyOf": [{"properties": {"g": {}}}],
            "allOf": [{"properties": {"h": {}}}, {"properties": {"i": {}}}]
        }));
        let closed = |v: &Value| v.get("additionalProperties") == Some(&json!(false));
        let p = &s["properties"];
        assert!(closed(&s) && closed(&p["a"]) && closed(&p["list"]["items"]));
        assert!(closed(&s["$defs"]["node"]) && closed(&s["anyOf"][0]));
        assert!(!closed(&p["open"]), "no properties listed: any object");
        assert_eq!(
            p["said"]["additionalProperties"]["additionalProperties"],
            json!(false),
            "said, and inside"
        );
        assert!(!closed(&p["pattern"]), "patternProperties say which other keys");
        assert!(!closed(&s["allOf"][0]) && !closed(&s["allOf"][1]), "an allOf's parts stay open");
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
