//! The document against the router: every route documented, every
//! documented operation routed, and the document's own rules.

use std::collections::BTreeSet;

use serde_json::Value;

use super::*;

const METHODS: &[&str] = &["get", "put", "post", "delete", "options", "head", "patch"];

fn document() -> Value {
    super::document().clone()
}

fn documented() -> BTreeSet<(String, String)> {
    let doc = document();
    let paths = doc["paths"].as_object().expect("paths is an object");
    paths
        .iter()
        .flat_map(|(path, item)| {
            let item = item.as_object().expect("a path item is an object");
            item.keys()
                .filter(|key| METHODS.contains(&key.as_str()))
                .map(|method| (method.clone(), path.clone()))
                .collect::<Vec<_>>()
        })
        .collect()
}

fn routed() -> BTreeSet<(String, String)> {
    crate::route_table()
        .into_iter()
        .map(|(method, path)| (method.as_str().to_ascii_lowercase(), openapi_path(path)))
        .collect()
}

#[test]
fn every_route_is_documented() {
    let missing: Vec<_> = routed().difference(&documented()).cloned().collect();
    assert!(
        missing.is_empty(),
        "routes missing from openapi.json: {missing:?}"
    );
}

#[test]
fn every_documented_operation_is_routed() {
    let extra: Vec<_> = documented().difference(&routed()).cloned().collect();
    assert!(extra.is_empty(), "documented but not routed: {extra:?}");
}

#[test]
fn the_document_is_openapi_3_1_with_bearer_auth() {
    let doc = document();
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(
        doc["components"]["securitySchemes"]["bearerAuth"]["scheme"],
        "bearer"
    );
    assert_eq!(
        doc["components"]["securitySchemes"]["apiKeyHeader"],
        serde_json::json!({"type": "apiKey", "in": "header", "name": "x-api-key",
            "description": doc["components"]["securitySchemes"]["apiKeyHeader"]["description"]})
    );
    for (method, path) in documented() {
        let op = &doc["paths"][&path][&method];
        let security = op.get("security");
        if (method.as_str(), path.as_str()) == ("get", crate::auth::PUBLIC_HEALTH_PATH) {
            assert_eq!(security, Some(&serde_json::json!([])), "{method} {path}");
        } else {
            // Either header carries the key.
            assert_eq!(
                security,
                Some(&serde_json::json!([{"bearerAuth": []}, {"apiKeyHeader": []}])),
                "{method} {path}"
            );
            let unauthorized = if path.starts_with("/v1/messages") {
                "#/components/responses/AnthropicUnauthorized"
            } else {
                "#/components/responses/Unauthorized"
            };
            assert_eq!(
                op["responses"]["401"]["$ref"], unauthorized,
                "{method} {path}: 401"
            );
        }
        assert!(
            op["operationId"].is_string(),
            "{method} {path}: operationId"
        );
        assert!(op["responses"].get("200").is_some(), "{method} {path}: 200");
    }
}

/// Every `$ref` points at a schema or response the document defines.
#[test]
fn every_reference_resolves() {
    fn walk(value: &Value, doc: &Value, bad: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(target)) = map.get("$ref") {
                    let pointer = target.trim_start_matches('#');
                    if doc.pointer(pointer).is_none() {
                        bad.push(target.clone());
                    }
                }
                map.values().for_each(|v| walk(v, doc, bad));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, doc, bad)),
            _ => {}
        }
    }
    let doc = document();
    let mut bad = Vec::new();
    walk(&doc, &doc, &mut bad);
    assert!(bad.is_empty(), "dangling $ref: {bad:?}");
}

/// Request objects refuse other keys (validation names them), free-form
/// values and response objects say nothing of them.
#[test]
fn request_objects_are_closed() {
    let doc = document();
    let schemas = &doc["components"]["schemas"];
    for name in [
        "CreateChatCompletionRequest",
        "CreateCompletionRequest",
        "StreamOptions",
        "SystemMessage",
        "ContentPart",
        "NamedToolChoice",
        "JsonSchemaFormat",
    ] {
        assert_eq!(schemas[name]["additionalProperties"], false, "{name}");
    }
    let function = &schemas["FunctionDefinition"];
    assert_eq!(function["additionalProperties"], false);
    assert_eq!(
        function["properties"]["parameters"].get("additionalProperties"),
        None
    );
    let chat = &schemas["CreateChatCompletionRequest"]["properties"];
    assert_eq!(
        chat["chat_template_kwargs"].get("additionalProperties"),
        None
    );
    assert_eq!(chat["logit_bias"]["additionalProperties"]["maximum"], 100);
    for name in ["ChatCompletion", "ChatChoice", "ErrorResponse"] {
        assert_eq!(schemas[name].get("additionalProperties"), None, "{name}");
    }
}

#[test]
fn catch_all_paths_use_openapi_syntax() {
    assert_eq!(openapi_path("/v1/models/{*id}"), "/v1/models/{id}");
    assert_eq!(openapi_path("/v1/models"), "/v1/models");
}
