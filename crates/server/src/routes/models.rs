//! `GET /v1/models` and `GET /v1/models/{model}`: the one model this server serves.

use crate::error::ApiError;
use crate::types::{ModelCard, ModelList};
use crate::AppState;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::Json;

fn card(state: &AppState) -> ModelCard {
    ModelCard { id: state.config.model_name.clone(), object: "model", created: state.started, owned_by: "specula", max_model_len: state.config.max_model_len }
}

pub async fn list(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList { object: "list", data: vec![card(&state)] })
}

pub async fn retrieve(State(state): State<AppState>, model: Result<Path<String>, PathRejection>) -> Result<Json<ModelCard>, ApiError> {
    let Path(model) = model.map_err(|e| ApiError::invalid_param("model", e.body_text()))?;
    if !state.config.serves(&model) {
        return Err(ApiError::model_not_found(&model, &state.config.model_name));
    }
    Ok(Json(card(&state)))
}
