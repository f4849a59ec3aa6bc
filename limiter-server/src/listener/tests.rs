use super::*;

#[test]
fn caps_fit_the_file_limit_with_room_to_spare() {
    let (grpc, admin) = default_caps(1024);
    assert_eq!((grpc, admin), (672, 112));
    assert!(grpc + admin + RESERVED_FILES as usize <= 1024);
    let (grpc, admin) = default_caps(1 << 20);
    assert!(grpc > 100_000 && admin == 4_096);
    // A tiny limit still leaves both listeners some room.
    let (grpc, admin) = default_caps(10);
    assert!(grpc >= 12 && admin >= 4);
}

/// A listener on a free loopback port with these bounds: its address, and the
/// connections it hands over.
async fn listen(
    max: usize,
    header_timeout: Duration,
    idle_timeout: Duration,
) -> (std::net::SocketAddr, mpsc::Receiver<Conn<TcpStream>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = ConnectionLimits { max, header_timeout, idle_timeout };
    (addr, accept(listener, "test", limits, CancellationToken::new()))
}

#[tokio::test]
async fn a_silent_connection_times_out_and_a_busy_one_does_not() {
    use tokio::io::AsyncReadExt as _;
    let (addr, mut rx) = listen(1, Duration::from_millis(200), Duration::from_millis(400)).await;
    let _client = TcpStream::connect(addr).await.unwrap();
    let mut conn = rx.recv().await.unwrap();
    // A request in flight keeps it open past both timeouts.
    let busy = conn.activity().begin();
    // The cap is one, and the connection has asked: a second one is closed at once.
    let mut second = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0; 8];
    let closed = tokio::time::timeout(Duration::from_secs(5), second.read(&mut buf)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    let read = tokio::time::timeout(Duration::from_millis(900), conn.read(&mut buf)).await;
    assert!(read.is_err(), "still open while busy");
    drop(busy);
    // Idle from now: closed after the idle timeout, not before.
    let started = Instant::now();
    let err = conn.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(350), "{waited:?}");
    assert!(waited <= Duration::from_millis(1500), "{waited:?}");
}

#[tokio::test]
async fn a_connection_that_never_asks_is_closed_after_the_header_timeout() {
    use tokio::io::AsyncReadExt as _;
    let (addr, mut rx) = listen(4, Duration::from_millis(150), Duration::from_secs(60)).await;
    let _client = TcpStream::connect(addr).await.unwrap();
    let mut conn = rx.recv().await.unwrap();
    let started = Instant::now();
    let mut buf = [0; 8];
    let err = conn.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn at_the_cap_an_idle_connection_that_asked_gives_way_and_a_busy_one_does_not() {
    use tokio::io::AsyncReadExt as _;
    let (addr, mut rx) = listen(1, Duration::from_secs(60), Duration::from_secs(60)).await;
    let _one = TcpStream::connect(addr).await.unwrap();
    let mut first = rx.recv().await.unwrap();
    // A request in flight: a new connection at the cap is refused.
    let busy = first.activity().begin();
    let mut refused = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0; 8];
    let closed = tokio::time::timeout(Duration::from_secs(5), refused.read(&mut buf)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    // The request ends: asked once and idle now, it gives way to the next one.
    drop(busy);
    let reader = tokio::spawn(async move {
        let mut buf = [0; 8];
        first.read(&mut buf).await.map_err(|e| e.kind())
    });
    let _two = TcpStream::connect(addr).await.unwrap();
    let second = rx.recv().await.unwrap();
    let evicted = tokio::time::timeout(Duration::from_secs(5), reader).await.unwrap().unwrap();
    assert_eq!(evicted, Err(io::ErrorKind::TimedOut));
    drop(second);
}

#[tokio::test]
async fn at_the_cap_a_new_connection_takes_the_place_of_one_that_never_asked() {
    use tokio::io::AsyncReadExt as _;
    let (addr, mut rx) = listen(1, Duration::from_secs(60), Duration::from_secs(60)).await;
    let _idle = TcpStream::connect(addr).await.unwrap();
    let mut first = rx.recv().await.unwrap();
    let reader = tokio::spawn(async move {
        let mut buf = [0; 8];
        first.read(&mut buf).await.map_err(|e| e.kind())
    });
    let _asks = TcpStream::connect(addr).await.unwrap();
    let second = rx.recv().await.unwrap();
    let evicted = tokio::time::timeout(Duration::from_secs(5), reader).await.unwrap().unwrap();
    assert_eq!(evicted, Err(io::ErrorKind::TimedOut), "the silent one was closed");
    drop(second);
}
