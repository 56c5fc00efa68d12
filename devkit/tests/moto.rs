//! moto's EC2 server as the tests of the cloud side get it: installed by
//! the project's own script, started on loopback, answering the EC2 Query
//! API per region, one server per test.

use std::collections::BTreeMap;
use std::time::Duration;

use berth_devkit::moto::{Ec2, Ec2Error, ErrorDocument, Fault, FaultProxy, Launch, Moto};

#[tokio::test]
async fn moto_answers_the_ec2_query_api_per_region_and_forgets_on_reset() {
    let moto = Moto::start().await.expect("moto starts");
    assert!(moto.endpoint().starts_with("http://127.0.0.1:"));

    // The region comes from the request's credential scope, as with EC2.
    let (status, zones) = moto
        .ec2(
            "eu-west-1",
            "Action=DescribeAvailabilityZones&Version=2016-11-15",
        )
        .await
        .expect("an answer");
    assert_eq!(status, 200, "{zones}");
    assert!(zones.contains("<zoneName>eu-west-1a</zoneName>"), "{zones}");
    assert!(!zones.contains("us-east-1a"), "{zones}");

    // Errors come back as EC2's error document, with EC2's codes.
    let (status, err) = moto
        .ec2(
            "eu-west-1",
            "Action=TerminateInstances&Version=2016-11-15&InstanceId.1=i-0123456789abcdef0",
        )
        .await
        .expect("an answer");
    assert_eq!(status, 400, "{err}");
    assert!(
        err.contains("<Code>InvalidInstanceID.NotFound</Code>"),
        "{err}"
    );

    // A security group made, then forgotten on reset.
    let (status, made) = moto
        .ec2(
            "eu-west-1",
            "Action=CreateSecurityGroup&Version=2016-11-15&GroupName=berth-test&GroupDescription=test",
        )
        .await
        .expect("an answer");
    assert_eq!(status, 200, "{made}");
    let named = "Action=DescribeSecurityGroups&Version=2016-11-15&GroupName.1=berth-test";
    let (status, _) = moto.ec2("eu-west-1", named).await.expect("an answer");
    assert_eq!(status, 200);
    assert!(moto.reset().await, "reset");
    let (status, gone) = moto.ec2("eu-west-1", named).await.expect("an answer");
    assert_eq!(status, 400, "{gone}");
    assert!(gone.contains("InvalidGroup.NotFound"), "{gone}");
}

#[tokio::test]
async fn each_server_is_its_own() {
    let (a, b) = tokio::join!(Moto::start(), Moto::start());
    let (a, b) = (a.expect("a starts"), b.expect("b starts"));
    assert_ne!(a.endpoint(), b.endpoint());
    let make =
        "Action=CreateSecurityGroup&Version=2016-11-15&GroupName=only-in-a&GroupDescription=test";
    assert_eq!(a.ec2("us-east-1", make).await.expect("answer").0, 200);
    let named = "Action=DescribeSecurityGroups&Version=2016-11-15&GroupName.1=only-in-a";
    assert_eq!(a.ec2("us-east-1", named).await.expect("answer").0, 200);
    assert_eq!(b.ec2("us-east-1", named).await.expect("answer").0, 400);
    drop(a);
    drop(b);
}

/// The helpers the `aws` tests seed moto with: an instance launched with
/// tags (instance and volume) from an image and a default subnet moto
/// knows, read back by id and by tag.
#[tokio::test]
async fn instances_are_launched_with_tags_and_read_back_by_id_and_tag() {
    let moto = Moto::start().await.expect("moto starts");
    let ec2 = moto.client("eu-west-1");
    let subnets = ec2.default_subnets().await.expect("subnets");
    let zones: Vec<&str> = subnets.iter().map(|s| s.zone.as_str()).collect();
    assert_eq!(zones, ["eu-west-1a", "eu-west-1b", "eu-west-1c"]);

    let launched = ec2
        .launch(
            &Launch::tagged(&[("berth.dev/cluster", "c1"), ("Name", "m1")])
                .volume_tag("berth.dev/cluster", "c1")
                .zone("eu-west-1b")
                .instance_type("m5.large"),
        )
        .await
        .expect("launched");
    assert!(launched.id.starts_with("i-"), "{launched:?}");
    assert_eq!(launched.zone.as_deref(), Some("eu-west-1b"));
    assert_eq!(
        launched.provider_id(),
        Some(format!("aws:///eu-west-1b/{}", launched.id))
    );
    let untagged = ec2.launch(&Launch::default()).await.expect("launched");
    assert!(untagged.tags.is_empty(), "{untagged:?}");

    let read = ec2
        .instance(&launched.id)
        .await
        .expect("described")
        .expect("known");
    assert_eq!(read.state, "running", "moto runs an instance at once");
    assert_eq!(read.tags.get("Name").map(String::as_str), Some("m1"));
    assert_eq!(read.instance_type.as_deref(), Some("m5.large"));
    assert!(read.launch_time.is_some(), "{read:?}");
    assert!(
        read.private_dns_name
            .as_deref()
            .is_some_and(|n| n.ends_with(".eu-west-1.compute.internal")),
        "{read:?}"
    );
    let volumes = ec2.volumes_of(&launched.id).await.expect("volumes");
    assert_eq!(volumes.len(), 1, "{volumes:?}");
    assert_eq!(
        volumes[0].tags.get("berth.dev/cluster").map(String::as_str),
        Some("c1")
    );

    let tagged = ec2
        .instances_tagged("berth.dev/cluster", "c1")
        .await
        .expect("listed");
    assert_eq!(
        tagged.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
        [launched.id.as_str()]
    );

    ec2.terminate(&[&launched.id]).await.expect("terminated");
    assert_eq!(
        ec2.instance_state(&launched.id).await.expect("described"),
        Some("terminated".into())
    );
    assert_eq!(
        ec2.instance_state("i-0123456789abcdef0")
            .await
            .expect("described"),
        None
    );
}

/// The proxy forwards every request to moto as it is (the region in the
/// signature included), keeps its client's connection alive although moto
/// closes every one, and counts requests by Action.
#[tokio::test]
async fn the_proxy_passes_requests_through_and_counts_them_by_action() {
    let moto = Moto::start().await.expect("moto starts");
    let proxy = FaultProxy::start(&moto.endpoint())
        .await
        .expect("proxy starts");
    let ec2 = Ec2::new(&proxy.endpoint(), "eu-west-1");

    let zones = ec2
        .call::<&str, &str>("DescribeAvailabilityZones", &[])
        .await
        .expect("zones");
    let names: Vec<String> = zones
        .items("availabilityZoneInfo")
        .filter_map(|z| z.text_at(&["zoneName"]))
        .collect();
    assert!(names.contains(&"eu-west-1a".to_string()), "{names:?}");

    let launched = ec2.launch(&Launch::default()).await.expect("launched");
    let direct = moto.client("eu-west-1");
    assert!(
        direct
            .instance(&launched.id)
            .await
            .expect("described")
            .is_some(),
        "the launch reached moto"
    );
    // moto's own errors pass as they are.
    let err = ec2
        .terminate(&["i-0123456789abcdef0"])
        .await
        .expect_err("unknown instance");
    assert_eq!(err.code(), Some("InvalidInstanceID.NotFound"), "{err}");

    assert_eq!(
        proxy.counts(),
        BTreeMap::from(
            [
                ("DescribeAvailabilityZones", 1),
                ("DescribeSubnets", 1),
                ("DescribeImages", 1),
                ("RunInstances", 1),
                ("TerminateInstances", 1),
            ]
            .map(|(a, n)| (a.to_string(), n))
        )
    );
    assert_eq!(proxy.passed("RunInstances"), 1);
    assert_eq!(proxy.faulted("RunInstances"), 0);
    assert_eq!(
        proxy.connections(),
        1,
        "five requests in turn on one kept-alive connection"
    );
}

/// A fault answers its Action's next N requests with EC2's own error
/// document, then the requests pass; other Actions are not touched.
#[tokio::test]
async fn injected_faults_answer_n_times_then_requests_pass() {
    let moto = Moto::start().await.expect("moto starts");
    let proxy = FaultProxy::start(&moto.endpoint())
        .await
        .expect("proxy starts");
    let ec2 = Ec2::new(&proxy.endpoint(), "eu-west-1");
    proxy.inject(Fault::throttled("RunInstances").times(2));

    for _ in 0..2 {
        match ec2.launch(&Launch::default()).await {
            Err(Ec2Error::Api {
                status,
                code,
                message,
                ..
            }) => {
                assert_eq!(status, 503);
                assert_eq!(code, "RequestLimitExceeded");
                assert_eq!(message, "Request limit exceeded.");
            }
            other => panic!("throttled, not {other:?}"),
        }
    }
    let launched = ec2.launch(&Launch::default()).await.expect("third passes");
    assert_eq!(proxy.requests("RunInstances"), 3);
    assert_eq!(proxy.faulted("RunInstances"), 2);
    assert_eq!(proxy.passed("RunInstances"), 1);
    assert_eq!(
        proxy.requests("DescribeSubnets"),
        3,
        "other Actions pass while a fault is armed"
    );
    assert!(proxy.armed().is_empty(), "spent: {:?}", proxy.armed());
    let all = moto
        .client("eu-west-1")
        .instances(&[])
        .await
        .expect("listed");
    assert_eq!(
        all.iter().map(|i| &i.id).collect::<Vec<_>>(),
        [&launched.id],
        "only the request that passed reached moto"
    );

    // The document is EC2's, byte for byte in shape.
    proxy.inject(Fault::ec2_error(
        "DescribeInstances",
        400,
        "InvalidParameterValue",
        "a <bad> & value",
    ));
    let (status, body) = ec2
        .send("Action=DescribeInstances&Version=2016-11-15")
        .await
        .expect("an answer");
    assert_eq!(status, 400);
    assert!(
        body.starts_with(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error>\
             <Code>InvalidParameterValue</Code><Message>a &lt;bad&gt; &amp; value</Message>\
             </Error></Errors><RequestID>"
        ),
        "{body}"
    );
    let doc = ErrorDocument::parse(&body).expect("EC2's error document");
    assert_eq!(doc.message, "a <bad> & value");
    assert!(!doc.request_id.is_empty(), "{body}");
}

/// A fault for ever answers until cleared; a load balancer's 5xx has an
/// empty or an HTML body; a connection can close unanswered, before or
/// after moto acted on the request; a delay passes late.
#[tokio::test]
async fn forever_faults_and_what_a_load_balancer_answers() {
    let moto = Moto::start().await.expect("moto starts");
    let proxy = FaultProxy::start(&moto.endpoint())
        .await
        .expect("proxy starts");
    let ec2 = Ec2::new(&proxy.endpoint(), "us-east-1");

    proxy.inject(Fault::internal_error("DescribeInstances").forever());
    for _ in 0..5 {
        let err = ec2.instances(&[]).await.expect_err("faulted");
        assert_eq!(err.code(), Some("InternalError"), "{err}");
    }
    assert_eq!(proxy.faulted("DescribeInstances"), 5);
    assert_eq!(proxy.armed().len(), 1, "a fault for ever stays armed");
    proxy.clear();
    ec2.instances(&[]).await.expect("passes once cleared");

    proxy.inject(Fault::empty("*", 503));
    let (status, body) = ec2
        .send("Action=DescribeRegions&Version=2016-11-15")
        .await
        .expect("an answer");
    assert_eq!((status, body.as_str()), (503, ""));
    proxy.inject(Fault::html("DescribeRegions", 502));
    match ec2.call::<&str, &str>("DescribeRegions", &[]).await {
        Err(Ec2Error::Unreadable { status, reason, .. }) => {
            assert_eq!(status, 502);
            assert!(reason.contains("502 Bad Gateway"), "{reason}");
        }
        other => panic!("an HTML page, not {other:?}"),
    }

    proxy.inject(Fault::close("DescribeRegions"));
    match ec2.call::<&str, &str>("DescribeRegions", &[]).await {
        Err(Ec2Error::Http { .. }) => {}
        other => panic!("no answer, not {other:?}"),
    }

    // The launch happens; its answer is lost on the way back.
    proxy.inject(Fault::lose_answer("RunInstances"));
    match ec2.launch(&Launch::tagged(&[("lost", "yes")])).await {
        Err(Ec2Error::Http { .. }) => {}
        other => panic!("no answer, not {other:?}"),
    }
    let launched = moto
        .client("us-east-1")
        .instances_tagged("lost", "yes")
        .await
        .expect("listed");
    assert_eq!(launched.len(), 1, "the instance exists: {launched:?}");
    assert_eq!(proxy.passed("RunInstances"), 1);
    assert_eq!(proxy.faulted("RunInstances"), 0);

    // An answer passed on with a part of it replaced.
    proxy.inject(Fault::rewrite(
        "DescribeInstances",
        "<name>running</name>",
        "<name>shutting-down</name>",
    ));
    let id = &launched[0].id;
    let said = ec2.instance_state(id).await.expect("described");
    assert_eq!(said.as_deref(), Some("shutting-down"));
    let said = ec2.instance_state(id).await.expect("described");
    assert_eq!(said.as_deref(), Some("running"), "rewritten once");
    assert_eq!(proxy.passed("DescribeInstances"), 2 + 1);

    proxy.inject(Fault::delay("DescribeRegions", Duration::from_millis(700)));
    let started = std::time::Instant::now();
    ec2.call::<&str, &str>("DescribeRegions", &[])
        .await
        .expect("passes late");
    assert!(started.elapsed() >= Duration::from_millis(700));

    assert_eq!(proxy.requests("DescribeRegions"), 4);
    assert_eq!(proxy.faulted("DescribeRegions"), 3);
    assert_eq!(proxy.passed("DescribeRegions"), 1);
    let statuses: Vec<Option<u16>> = proxy
        .seen()
        .iter()
        .filter(|s| s.action == "DescribeRegions")
        .map(|s| s.status)
        .collect();
    assert_eq!(statuses, [Some(503), Some(502), None, Some(200)]);
}
