//! gRPC server reflection, as grpcurl, grpcui and Postman use it: both protocol
//! versions list every service, and every file a service needs resolves, down to
//! the well-known types, so a tool can build requests for each method.

mod common;

use std::collections::{BTreeSet, HashSet};

use common::TestServer;
use prost::Message as _;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

const POLICY: &str = "
version: 1
tenants:
  default:
    limit: { algorithm: token_bucket, rate: 10/s, burst: 10 }
";

const SERVICES: [&str; 5] = [
    "limiter.v1.RateLimiter",
    "envoy.service.ratelimit.v3.RateLimitService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

async fn ask(
    c: &mut ServerReflectionClient<tonic::transport::Channel>,
    request: MessageRequest,
) -> MessageResponse {
    let req = ServerReflectionRequest { host: String::new(), message_request: Some(request) };
    let mut answers =
        c.server_reflection_info(tokio_stream::iter([req])).await.unwrap().into_inner();
    let ServerReflectionResponse { message_response, .. } =
        answers.message().await.unwrap().expect("one answer");
    message_response.expect("a message")
}

fn files_of(answer: MessageResponse) -> Vec<prost_types::FileDescriptorProto> {
    let MessageResponse::FileDescriptorResponse(files) = answer else {
        panic!("expected file descriptors, got {answer:?}");
    };
    files
        .file_descriptor_proto
        .iter()
        .map(|b| prost_types::FileDescriptorProto::decode(b.as_slice()).unwrap())
        .collect()
}

#[tokio::test]
async fn reflection_lists_every_service_and_resolves_their_files() {
    let s = TestServer::start(POLICY).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = ServerReflectionClient::new(channel.clone());

    let MessageResponse::ListServicesResponse(list) =
        ask(&mut c, MessageRequest::ListServices(String::new())).await
    else {
        panic!("expected a service list");
    };
    let listed: BTreeSet<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for want in SERVICES {
        assert!(listed.contains(want), "{want} not listed in {listed:?}");
    }

    // Each service's file, then every dependency by name, as a tool walks them.
    for service in [
        "limiter.v1.RateLimiter",
        "envoy.service.ratelimit.v3.RateLimitService",
        "grpc.health.v1.Health",
    ] {
        let files =
            files_of(ask(&mut c, MessageRequest::FileContainingSymbol(service.into())).await);
        let (package, name) = service.rsplit_once('.').unwrap();
        let own = files
            .iter()
            .find(|f| f.package() == package && f.service.iter().any(|s| s.name() == name))
            .unwrap_or_else(|| panic!("{service}: its own file is not in the answer"));
        assert!(!own.service[0].method.is_empty());
        let mut seen: HashSet<String> = files.iter().map(|f| f.name().to_owned()).collect();
        let mut todo: Vec<String> = files.iter().flat_map(|f| f.dependency.clone()).collect();
        while let Some(dep) = todo.pop() {
            if !seen.insert(dep.clone()) {
                continue;
            }
            let got = files_of(ask(&mut c, MessageRequest::FileByFilename(dep.clone())).await);
            assert!(got.iter().any(|f| f.name() == dep), "{service}: dependency {dep} not served");
            todo.extend(got.iter().flat_map(|f| f.dependency.clone()));
        }
    }

    // A message type a tool needs to build a ShouldAllow request.
    let files = files_of(
        ask(&mut c, MessageRequest::FileContainingSymbol("limiter.v1.ShouldAllowRequest".into()))
            .await,
    );
    assert!(files.iter().any(|f| f.message_type.iter().any(|m| m.name() == "ShouldAllowRequest")));

    // An unknown symbol is NOT_FOUND (tonic's reflection ends the call with it).
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol("no.such.Service".into())),
    };
    let mut answers =
        c.server_reflection_info(tokio_stream::iter([req])).await.unwrap().into_inner();
    match answers.message().await {
        Err(status) => assert_eq!(status.code(), tonic::Code::NotFound),
        Ok(Some(ServerReflectionResponse {
            message_response: Some(MessageResponse::ErrorResponse(e)),
            ..
        })) => {
            assert_eq!(e.error_code, tonic::Code::NotFound as i32);
        }
        other => panic!("expected NOT_FOUND for an unknown symbol, got {other:?}"),
    }

    // The older protocol version lists the same services.
    let mut old =
        tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient::new(
            channel,
        );
    let req = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut answers =
        old.server_reflection_info(tokio_stream::iter([req])).await.unwrap().into_inner();
    let answer = answers.message().await.unwrap().unwrap().message_response.unwrap();
    let tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list) = answer
    else {
        panic!("expected a service list from v1alpha");
    };
    let listed: BTreeSet<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for want in SERVICES {
        assert!(listed.contains(want), "v1alpha: {want} not listed in {listed:?}");
    }
    s.stop().await;
}

/// With `security.grpc.auth: token`, reflection is a client's call like any other:
/// refused without a token, answered with one.
#[tokio::test]
async fn reflection_asks_for_credentials_where_the_port_does() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "gateway client reflect-secret\n").unwrap();
    let tokens = tokens.display().to_string();
    let s = TestServer::start_with(
        POLICY,
        &[("LIMITER__SECURITY__TOKENS_FILE", &tokens), ("LIMITER__SECURITY__GRPC__AUTH", "token")],
    )
    .await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let list = || ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut c = ServerReflectionClient::new(channel.clone());
    let refused = c.server_reflection_info(tokio_stream::iter([list()])).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(tokio_stream::iter([list()]));
    req.metadata_mut().insert("authorization", "Bearer reflect-secret".parse().unwrap());
    let mut answers = c.server_reflection_info(req).await.unwrap().into_inner();
    let answer = answers.message().await.unwrap().unwrap().message_response.unwrap();
    assert!(matches!(answer, MessageResponse::ListServicesResponse(l) if !l.service.is_empty()));
    s.stop().await;
}
