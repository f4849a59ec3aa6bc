use super::*;

#[test]
fn the_tokens_file_names_every_bad_line() {
    let text = "# name roles token\n\
                gw client xyz\n\
                node peer sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\n\
                \n\
                bad client\n\
                x wizard t1\n\
                y client sha256:12\n\
                z client abc\n";
    let e = Tokens::parse(Path::new("tokens.txt"), text).unwrap_err();
    assert!(e.contains("tokens.txt:5: expected `name roles token`, found 2 fields"), "{e}");
    assert!(e.contains("tokens.txt:6: role `wizard`"), "{e}");
    assert!(e.contains("tokens.txt:7: `sha256:` needs 64 hex digits"), "{e}");
    assert!(e.contains("tokens.txt:8: the same token as `node`"), "{e}");
    assert!(!e.contains("tokens.txt:2"), "{e}");
}

#[test]
fn tokens_are_found_by_value_or_digest() {
    // sha256("abc")
    let text = "gw client t0ken\n\
                node peer sha256:BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD\n\
                ops admin,client t1\n";
    let t = Tokens::parse(Path::new("t"), text).unwrap();
    assert_eq!(t.len(), 3);
    assert_eq!(&*t.find("t0ken").unwrap().name, "gw");
    let node = t.find("abc").unwrap();
    assert!(node.roles.peer && node.roles.client && !node.roles.admin);
    assert!(t.find("t0ke").is_none());
    assert!(t.find("").is_none());
    let ops = t.find("t1").unwrap().roles;
    assert!(ops.admin && ops.client && !ops.peer);
}

fn request(path: &str, headers: &[(&str, &str)]) -> http::Request<()> {
    let mut r = http::Request::builder().uri(path);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.body(()).unwrap()
}

#[test]
fn calls_need_the_role_they_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens");
    std::fs::write(&path, "gw client c1\nnode peer p1\n").unwrap();
    let tokens = Arc::new(TokenFile::load(path.clone()).unwrap());
    let g = Guard::new(
        "grpc",
        Protocol::Grpc,
        AuthMode::Token,
        Some(tokens.clone()),
        &["/grpc.health.v1.Health/"],
    )
    .unwrap();
    let allow = "/limiter.v1.RateLimiter/ShouldAllow";
    let handoff = "/limiter.v1.RateLimiter/Handoff";
    let check = |path: &str, h: &[(&str, &str)]| g.check(&request(path, h)).map_err(|e| e.0);
    assert_eq!(check("/grpc.health.v1.Health/Check", &[]), Ok(()));
    assert_eq!(check(allow, &[]), Err(Refusal::NoCredentials));
    assert_eq!(check(allow, &[("authorization", "Basic x")]), Err(Refusal::Malformed));
    assert_eq!(check(allow, &[("authorization", "Bearer nope")]), Err(Refusal::UnknownToken));
    assert_eq!(check(allow, &[("authorization", "Bearer c1")]), Ok(()));
    assert_eq!(check(allow, &[("authorization", "Bearer p1")]), Ok(()));
    assert_eq!(check(handoff, &[("authorization", "Bearer c1")]), Err(Refusal::NotAllowed));
    assert_eq!(
        check(allow, &[("authorization", "Bearer c1"), (FORWARDED, "1")]),
        Err(Refusal::NotAllowed)
    );
    assert_eq!(check(handoff, &[("authorization", "Bearer p1")]), Ok(()));
    // Replicas are a peer's too, with or without the forwarded header.
    let replicate = "/limiter.v1.RateLimiter/Replicate";
    assert_eq!(check(replicate, &[("authorization", "Bearer c1")]), Err(Refusal::NotAllowed));
    assert_eq!(check(replicate, &[("authorization", "Bearer p1")]), Ok(()));
    // A new version of the file takes over; a broken one is refused and changes nothing.
    std::fs::write(&path, "gw client c2\n").unwrap();
    assert_eq!(tokens.reload(), Some(Ok(())));
    assert_eq!(tokens.reload(), None);
    assert_eq!(check(allow, &[("authorization", "Bearer c1")]), Err(Refusal::UnknownToken));
    assert_eq!(check(allow, &[("authorization", "Bearer c2")]), Ok(()));
    std::fs::write(&path, "gw client\n").unwrap();
    assert!(matches!(tokens.reload(), Some(Err(_))));
    assert_eq!(check(allow, &[("authorization", "Bearer c2")]), Ok(()));
    let refused = g.refuse::<tonic::body::Body>(Refusal::NotAllowed, Role::Peer);
    assert_eq!(refused.headers()["grpc-status"], "7");
}

#[test]
fn the_admin_listener_needs_the_admin_role() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens");
    std::fs::write(&path, "gw client c1\nprom admin a1\n").unwrap();
    let tokens = Arc::new(TokenFile::load(path).unwrap());
    let g = Guard::new(
        "admin",
        Protocol::Http,
        AuthMode::Token,
        Some(tokens),
        &["/healthz", "/readyz"],
    )
    .unwrap();
    assert!(g.check(&request("/readyz", &[])).is_ok());
    assert_eq!(g.check(&request("/metrics", &[])).unwrap_err().0, Refusal::NoCredentials);
    assert_eq!(
        g.check(&request("/metrics", &[("authorization", "Bearer c1")])).unwrap_err().0,
        Refusal::NotAllowed
    );
    assert!(g.check(&request("/metrics", &[("authorization", "Bearer a1")])).is_ok());
    let r = g.refuse::<String>(Refusal::NoCredentials, Role::Admin);
    assert_eq!(r.status(), 401);
}
